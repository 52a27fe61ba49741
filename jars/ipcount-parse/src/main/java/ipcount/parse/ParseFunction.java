package ipcount.parse;

import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.catalyst.expressions.GenericInternalRow;
import org.apache.spark.sql.connector.catalog.functions.BoundFunction;
import org.apache.spark.sql.connector.catalog.functions.ScalarFunction;
import org.apache.spark.sql.connector.catalog.functions.UnboundFunction;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.unsafe.types.UTF8String;

/**
 * {@code ipcount.parse(value, kafka_ms, planned_at_ms, max_value_bytes, from_kafka, max_ahead_ms)}
 * -> {@code struct<ip, event_ms, reason>}: {@link RecordParser} as a Spark function. The long
 * arguments use {@link RecordParser#NONE} (Long.MIN_VALUE) for "none". Spark calls the static
 * {@code invoke} straight from its generated code, with no conversion of the arguments.
 */
public final class ParseFunction implements UnboundFunction, ScalarFunction<InternalRow> {
  private static final long serialVersionUID = 1L;
  static final ParseFunction INSTANCE = new ParseFunction();
  static final StructType RESULT = new StructType()
      .add("ip", DataTypes.StringType).add("event_ms", DataTypes.LongType).add("reason", DataTypes.StringType);
  private static final DataType[] INPUTS = {DataTypes.BinaryType, DataTypes.LongType, DataTypes.LongType,
      DataTypes.IntegerType, DataTypes.BooleanType, DataTypes.LongType};
  private static final UTF8String[] REASONS = new UTF8String[RecordParser.REASONS.length];
  private static final ThreadLocal<RecordParser> PARSER = ThreadLocal.withInitial(RecordParser::new);

  static {
    for (int r = 0; r < REASONS.length; r++) REASONS[r] = UTF8String.fromString(RecordParser.REASONS[r]);
  }

  private ParseFunction() {}

  @Override public String name() { return "parse"; }

  @Override public String description() {
    return "parse(value, kafka_ms, planned_at_ms, max_value_bytes, from_kafka, max_ahead_ms): "
        + "struct<ip, event_ms, reason> by ipcount's record format";
  }

  @Override public BoundFunction bind(StructType input) {
    if (input.fields().length != INPUTS.length) {
      throw new UnsupportedOperationException("ipcount.parse takes " + INPUTS.length + " arguments: " + description());
    }
    return this;
  }

  @Override public DataType[] inputTypes() { return INPUTS; }

  @Override public DataType resultType() { return RESULT; }

  @Override public boolean isResultNullable() { return false; }

  @Override public String canonicalName() { return "ipcount.parse"; }

  /** The magic method of ScalarFunction. */
  public static InternalRow invoke(byte[] value, long kafkaMs, long plannedAtMs, int maxValueBytes, boolean fromKafka,
                                   long maxAheadMs) {
    RecordParser parser = PARSER.get();
    int reason = parser.parse(value, kafkaMs, plannedAtMs, maxValueBytes, fromKafka, maxAheadMs);
    if (reason != RecordParser.WELL_FORMED) return new GenericInternalRow(new Object[] {null, null, REASONS[reason]});
    UTF8String ip = UTF8String.fromBytes(parser.ip, parser.ipOffset, parser.ipLength);
    return new GenericInternalRow(new Object[] {ip, parser.eventMs, null});
  }
}
