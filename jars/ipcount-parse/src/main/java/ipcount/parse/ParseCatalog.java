package ipcount.parse;

import org.apache.spark.sql.catalyst.analysis.NoSuchFunctionException;
import org.apache.spark.sql.connector.catalog.FunctionCatalog;
import org.apache.spark.sql.connector.catalog.Identifier;
import org.apache.spark.sql.connector.catalog.functions.UnboundFunction;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/**
 * The catalog that serves {@link ParseFunction}: with
 * {@code spark.sql.catalog.ipcount=ipcount.parse.ParseCatalog} it is {@code ipcount.parse(...)}
 * in SQL and {@code F.call_function("ipcount.parse", ...)}, in classic and Connect sessions alike.
 */
public final class ParseCatalog implements FunctionCatalog {
  private String name;

  @Override public void initialize(String name, CaseInsensitiveStringMap options) { this.name = name; }

  @Override public String name() { return name; }

  @Override public Identifier[] listFunctions(String[] namespace) {
    return namespace.length == 0 ? new Identifier[] {Identifier.of(namespace, "parse")} : new Identifier[0];
  }

  @Override public UnboundFunction loadFunction(Identifier ident) throws NoSuchFunctionException {
    // One instance: plans compare the function object, so equal calls are one subexpression.
    if (ident.namespace().length == 0 && ident.name().equalsIgnoreCase("parse")) return ParseFunction.INSTANCE;
    throw new NoSuchFunctionException(ident);
  }
}
