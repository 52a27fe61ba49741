package ipcount.parse;

import java.io.BufferedReader;
import java.io.BufferedWriter;
import java.io.IOException;
import java.io.InputStreamReader;
import java.io.OutputStreamWriter;
import java.nio.charset.StandardCharsets;
import java.util.HexFormat;

/**
 * {@link RecordParser} without Spark, one record per line, for the parity tests and for
 * checking by hand why a record is a dead letter. Input lines: {@code value-hex [kafka-ms
 * [planned-at-ms]]}, tab-separated, "-" for none; output lines: {@code reason ip event-ms}, "-"
 * for none.
 */
public final class Cli {
  private static final String USAGE = "usage: java -cp ipcount-parse.jar ipcount.parse.Cli [--max-value-bytes N]"
      + " [--event-time payload|kafka] [--max-ahead-ms N] < records\n"
      + "  each input line: value-hex [TAB kafka-ms [TAB planned-at-ms]], '-' for none\n"
      + "  each output line: reason TAB ip TAB event-ms, '-' for none (reason '-': well formed)";

  public static void main(String[] args) throws IOException {
    int maxValueBytes = 65_536;
    boolean fromKafka = false;
    long maxAheadMs = RecordParser.NONE;
    for (int a = 0; a < args.length; a++) {
      String arg = args[a];
      if (arg.equals("-h") || arg.equals("--help")) {
        System.out.println(USAGE);
        return;
      }
      if (a + 1 >= args.length) fail("missing the value of " + arg);
      String value = args[++a];
      try {
        switch (arg) {
          case "--max-value-bytes" -> maxValueBytes = Integer.parseInt(value);
          case "--max-ahead-ms" -> maxAheadMs = Long.parseLong(value);
          case "--event-time" -> {
            if (!value.equals("payload") && !value.equals("kafka")) {
              fail("--event-time is payload or kafka, not " + value);
            }
            fromKafka = value.equals("kafka");
          }
          default -> fail("unknown argument " + arg);
        }
      } catch (NumberFormatException e) {
        fail(arg + " takes a whole number, not " + value);
      }
    }
    RecordParser parser = new RecordParser();
    HexFormat hex = HexFormat.of();
    BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.US_ASCII));
    BufferedWriter out = new BufferedWriter(new OutputStreamWriter(System.out, StandardCharsets.US_ASCII));
    String line;
    int number = 0;
    while ((line = in.readLine()) != null) {
      number++;
      String[] fields = line.split("\t", -1);
      byte[] value;
      long kafkaMs, plannedAtMs;
      try {
        value = fields[0].equals("-") ? null : hex.parseHex(fields[0]);
        kafkaMs = fields.length > 1 ? optionalLong(fields[1]) : RecordParser.NONE;
        plannedAtMs = fields.length > 2 ? optionalLong(fields[2]) : RecordParser.NONE;
      } catch (IllegalArgumentException e) {
        fail("line " + number + ": " + e.getMessage());
        return;
      }
      int reason = parser.parse(value, kafkaMs, plannedAtMs, maxValueBytes, fromKafka, maxAheadMs);
      if (reason == RecordParser.WELL_FORMED) {
        out.write("-\t" + new String(parser.ip, parser.ipOffset, parser.ipLength, StandardCharsets.US_ASCII) + "\t"
            + parser.eventMs + "\n");
      } else {
        out.write(RecordParser.REASONS[reason] + "\t-\t-\n");
      }
    }
    out.flush();
  }

  private static long optionalLong(String text) {
    return text.equals("-") ? RecordParser.NONE : Long.parseLong(text);
  }

  private static void fail(String message) {
    System.err.println("ipcount.parse.Cli: " + message + "\n" + USAGE);
    System.exit(2);
  }
}
