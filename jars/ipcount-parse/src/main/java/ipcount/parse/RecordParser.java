package ipcount.parse;

import java.nio.ByteBuffer;
import java.util.HashSet;

/**
 * The record format of {@code ipcount/rules/records.py} (the specification) on the JVM: one
 * left-to-right pass over a Kafka record value's bytes, no regex and no JSON library, so that
 * it costs what reading the record needs. The Python rules are the ground truth; the parity
 * tests hold this class to them record by record.
 *
 * <p>Not thread-safe: a parser keeps scratch state between records (one per thread).
 */
public final class RecordParser {
  /** Reason codes, in the order they are checked (records.REASONS). */
  public static final String[] REASONS = {
      "null_value", "empty_value", "too_large", "not_utf8", "bad_json", "bad_shape", "unrecognized_format",
      "invalid_ip", "invalid_timestamp", "event_time_ahead"};
  public static final int WELL_FORMED = -1;
  static final int NULL_VALUE = 0, EMPTY_VALUE = 1, TOO_LARGE = 2, NOT_UTF8 = 3, BAD_JSON = 4, BAD_SHAPE = 5,
      UNRECOGNIZED = 6, INVALID_IP = 7, INVALID_TIMESTAMP = 8, EVENT_TIME_AHEAD = 9;
  /** "No value" for the long arguments (a missing Kafka timestamp, planning time, or lateness cap). */
  public static final long NONE = Long.MIN_VALUE;

  static final int MAX_JSON_DEPTH = 999;      // records.MAX_JSON_DEPTH
  static final int MAX_INT_DIGITS = 4300;     // Python 3.11's int_max_str_digits: json.loads fails past it
  static final long MIN_EVENT_MS = 946_684_800_000L, MAX_EVENT_MS = 4_102_444_800_000L;
  static final int MAX_OFFSET_MINUTES = 18 * 60;
  // Past this many keys an object's duplicate check hashes instead of comparing each pair.
  private static final int LINEAR_KEYS = 16;

  // -- the last record's result ---------------------------------------------------------
  /** The reason code of the last record, or {@link #WELL_FORMED}. */
  public int reason;
  /** The canonical IP text (ASCII) of a well-formed record: {@code ip[ipOffset, ipOffset + ipLength)}. */
  public byte[] ip;
  public int ipOffset, ipLength;
  /** The event time of a well-formed record, epoch milliseconds. */
  public long eventMs;

  // -- fields found by the JSON or NGINX scan ---------------------------------------------
  private static final int ABSENT = 0, STRING = 1, INTEGER = 2, OTHER = 3;
  private int ipKind, tsKind;
  private byte[] ipText, tsText;     // the field's text (decoded when it had escapes)
  private int ipStart, ipEnd, tsStart, tsEnd;
  private long tsInteger;

  // -- JSON scratch: the open containers and their keys -----------------------------------
  private boolean[] isObject = new boolean[16];
  private int[] keyMark = new int[16];
  @SuppressWarnings({"unchecked", "rawtypes"})
  private HashSet<ByteBuffer>[] keySets = new HashSet[16];
  private byte[][] keyArray = new byte[16][];
  private int[] keyStart = new int[16], keyEnd = new int[16];
  private int keys;
  private byte[] decoded;            // set by scanString when the string had escapes
  private int scanEnd;
  private final int[] hextets = new int[8];

  /**
   * Parses one record value. {@code kafkaMs} and {@code plannedAtMs} may be {@link #NONE};
   * {@code maxAheadMs} is {@link #NONE} when event times are not capped.
   *
   * @return the reason code, also left in {@link #reason}
   */
  public int parse(byte[] value, long kafkaMs, long plannedAtMs, int maxValueBytes, boolean fromKafka,
                   long maxAheadMs) {
    ip = null;
    eventMs = 0;
    if (value == null) return reason = NULL_VALUE;
    if (value.length == 0) return reason = EMPTY_VALUE;
    if (value.length > maxValueBytes) return reason = TOO_LARGE;
    if (!isUtf8(value)) return reason = NOT_UTF8;
    int start = 0, end = value.length;
    while (start < end && isTrimmed(value[start])) start++;
    while (end > start && isTrimmed(value[end - 1])) end--;
    boolean json = start < end && value[start] == '{';
    int found = json ? scanJson(value, start, end, fromKafka) : scanNginx(value, start, end);
    if (found != WELL_FORMED) return reason = found;
    if (!isIp(ipText, ipStart, ipEnd)) return reason = INVALID_IP;
    long ms;
    if (fromKafka) ms = kafkaMs;
    else if (tsKind == INTEGER) ms = tsInteger;
    else if (json) ms = isoMillis(tsText, tsStart, tsEnd);
    else ms = nginxMillis(tsText, tsStart, tsEnd);
    if (ms < MIN_EVENT_MS || ms >= MAX_EVENT_MS) return reason = INVALID_TIMESTAMP;
    if (maxAheadMs != NONE && isAhead(ms, maxAheadMs, kafkaMs, plannedAtMs)) return reason = EVENT_TIME_AHEAD;
    eventMs = ms;
    canonicalIp();
    return reason = WELL_FORMED;
  }

  /** records.is_ahead: later than the earlier known reference time (>= 0) by more than the cap. */
  static boolean isAhead(long eventMs, long maxAheadMs, long kafkaMs, long plannedAtMs) {
    long reference;
    if (kafkaMs >= 0 && plannedAtMs >= 0) reference = Math.min(kafkaMs, plannedAtMs);
    else if (kafkaMs >= 0) reference = kafkaMs;
    else if (plannedAtMs >= 0) reference = plannedAtMs;
    else return false;
    long limit = reference + maxAheadMs;
    if (maxAheadMs > 0 && limit < reference) return false;  // past Long.MAX_VALUE: nothing is later
    return eventMs > limit;
  }

  private static boolean isTrimmed(byte b) {
    return b == ' ' || b == '\t' || b == '\r' || b == '\n';
  }

  /** Strict UTF-8, as Python's bytes.decode: no overlongs, surrogates, stray or missing continuations. */
  static boolean isUtf8(byte[] v) {
    int i = 0, n = v.length;
    while (i < n) {
      int b = v[i];
      if (b >= 0) {
        i++;
        continue;
      }
      b &= 0xff;
      if (b < 0xC2) return false;
      if (b < 0xE0) {
        if (i + 1 >= n || !isContinuation(v[i + 1])) return false;
        i += 2;
      } else if (b < 0xF0) {
        if (i + 2 >= n || !isContinuation(v[i + 1]) || !isContinuation(v[i + 2])) return false;
        int b1 = v[i + 1] & 0xff;
        if ((b == 0xE0 && b1 < 0xA0) || (b == 0xED && b1 >= 0xA0)) return false;
        i += 3;
      } else if (b < 0xF5) {
        if (i + 3 >= n || !isContinuation(v[i + 1]) || !isContinuation(v[i + 2]) || !isContinuation(v[i + 3])) {
          return false;
        }
        int b1 = v[i + 1] & 0xff;
        if ((b == 0xF0 && b1 < 0x90) || (b == 0xF4 && b1 >= 0x90)) return false;
        i += 4;
      } else {
        return false;
      }
    }
    return true;
  }

  private static boolean isContinuation(byte b) {
    return (b & 0xC0) == 0x80;
  }

  // -- JSON ---------------------------------------------------------------------------------

  /**
   * Python's json.loads with duplicate keys (at any depth) and NaN/Infinity rejected, at most
   * {@link #MAX_JSON_DEPTH} levels and integers of at most {@link #MAX_INT_DIGITS} digits; then
   * the top-level object's shape: a string "ip" and (unless the event time is Kafka's) a string
   * or long "ts".
   */
  private int scanJson(byte[] v, int start, int end, boolean fromKafka) {
    ipKind = tsKind = ABSENT;
    keys = 0;
    int depth = 0, member = ABSENT;  // member: the top-level key just read (1 ip, 2 ts)
    int i = start;
    while (true) {
      // A value is expected at i.
      i = skipWhitespace(v, i, end);
      if (i >= end) return BAD_JSON;
      byte c = v[i];
      if (c == '{' || c == '[') {
        if (depth == 1 && member != ABSENT) record(member, OTHER, null, 0, 0);
        if (++depth > MAX_JSON_DEPTH) return BAD_JSON;
        open(depth, c == '{');
        i = skipWhitespace(v, i + 1, end);
        if (i < end && v[i] == (c == '{' ? '}' : ']')) {
          i++;
          depth--;
        } else if (c == '{') {
          if ((i = readKey(v, i, end, depth)) < 0) return BAD_JSON;
          member = depth == 1 ? topLevelMember(v) : ABSENT;
          continue;
        } else {
          member = ABSENT;
          continue;
        }
      } else if (c == '"') {
        int from = i + 1;
        if ((i = scanString(v, i, end)) < 0) return BAD_JSON;
        if (depth == 1 && member != ABSENT) {
          if (decoded != null) record(member, STRING, decoded, 0, decoded.length);
          else record(member, STRING, v, from, i - 1);
        }
      } else if (c == '-' || (c >= '0' && c <= '9')) {
        int from = i;
        if ((i = scanNumber(v, i, end)) < 0) return BAD_JSON;
        if (depth == 1 && member != ABSENT) {
          if (scanEnd < 0) record(member, OTHER, null, 0, 0);  // a float
          else record(member, INTEGER, v, from, i);
        }
      } else if (matches(v, i, end, "true") || matches(v, i, end, "null")) {
        i += 4;
        if (depth == 1 && member != ABSENT) record(member, OTHER, null, 0, 0);
      } else if (matches(v, i, end, "false")) {
        i += 5;
        if (depth == 1 && member != ABSENT) record(member, OTHER, null, 0, 0);
      } else {
        return BAD_JSON;
      }
      // After a value: a comma, the close of its container, or (at depth 0) the end.
      while (true) {
        i = skipWhitespace(v, i, end);
        if (depth == 0) {
          if (i != end) return BAD_JSON;
          return shape(fromKafka);
        }
        if (i >= end) return BAD_JSON;
        c = v[i];
        if (c == ',') {
          i++;
          if (isObject[depth]) {
            if ((i = readKey(v, skipWhitespace(v, i, end), end, depth)) < 0) return BAD_JSON;
            member = depth == 1 ? topLevelMember(v) : ABSENT;
          }
          break;
        }
        if (c != (isObject[depth] ? '}' : ']')) return BAD_JSON;
        i++;
        if (isObject[depth]) keys = keyMark[depth];
        depth--;
      }
    }
  }

  private int shape(boolean fromKafka) {
    if (ipKind != STRING) return BAD_SHAPE;
    if (!fromKafka) {
      if (tsKind == INTEGER) {
        if (!parseLong(tsText, tsStart, tsEnd)) return BAD_SHAPE;
      } else if (tsKind != STRING) {
        return BAD_SHAPE;
      }
    }
    return WELL_FORMED;
  }

  private void record(int member, int kind, byte[] text, int from, int to) {
    if (member == 1) {
      ipKind = kind;
      ipText = text;
      ipStart = from;
      ipEnd = to;
    } else {
      tsKind = kind;
      tsText = text;
      tsStart = from;
      tsEnd = to;
    }
  }

  /** Which top-level member the key just read names: 1 for "ip", 2 for "ts", else ABSENT. */
  private int topLevelMember(byte[] v) {
    int k = keys - 1;
    byte[] a = keyArray[k];
    int from = keyStart[k];
    if (keyEnd[k] - from != 2) return ABSENT;
    if (a[from] == 'i' && a[from + 1] == 'p') return 1;
    if (a[from] == 't' && a[from + 1] == 's') return 2;
    return ABSENT;
  }

  private void open(int depth, boolean object) {
    if (depth >= isObject.length) {
      int size = Math.min(isObject.length * 2, MAX_JSON_DEPTH + 1);
      isObject = java.util.Arrays.copyOf(isObject, size);
      keyMark = java.util.Arrays.copyOf(keyMark, size);
      keySets = java.util.Arrays.copyOf(keySets, size);
    }
    isObject[depth] = object;
    keyMark[depth] = keys;
    keySets[depth] = null;
  }

  /** Reads `"key" :` at i into the open object at depth, rejecting a duplicate; returns where its value starts. */
  private int readKey(byte[] v, int i, int end, int depth) {
    if (i >= end || v[i] != '"') return -1;
    int from = i + 1;
    if ((i = scanString(v, i, end)) < 0) return -1;
    byte[] a = v;
    int to = i - 1;
    if (decoded != null) {
      a = decoded;
      from = 0;
      to = decoded.length;
    }
    int mark = keyMark[depth];  // the keys past it are this object's: a closed object's keys are dropped
    if (keys >= keyArray.length) {
      int size = keyArray.length * 2;
      keyArray = java.util.Arrays.copyOf(keyArray, size);
      keyStart = java.util.Arrays.copyOf(keyStart, size);
      keyEnd = java.util.Arrays.copyOf(keyEnd, size);
    }
    if (keySets[depth] != null) {
      if (!keySets[depth].add(ByteBuffer.wrap(a, from, to - from).slice())) return -1;
    } else {
      for (int k = mark; k < keys; k++) {
        if (sameBytes(keyArray[k], keyStart[k], keyEnd[k], a, from, to)) return -1;
      }
      if (keys - mark >= LINEAR_KEYS) {
        HashSet<ByteBuffer> set = new HashSet<>();
        for (int k = mark; k < keys; k++) {
          set.add(ByteBuffer.wrap(keyArray[k], keyStart[k], keyEnd[k] - keyStart[k]).slice());
        }
        set.add(ByteBuffer.wrap(a, from, to - from).slice());
        keySets[depth] = set;
      }
    }
    keyArray[keys] = a;
    keyStart[keys] = from;
    keyEnd[keys] = to;
    keys++;
    i = skipWhitespace(v, i, end);
    if (i >= end || v[i] != ':') return -1;
    return i + 1;
  }

  private static boolean sameBytes(byte[] a, int aFrom, int aTo, byte[] b, int bFrom, int bTo) {
    return java.util.Arrays.equals(a, aFrom, aTo, b, bFrom, bTo);
  }

  private static int skipWhitespace(byte[] v, int i, int end) {
    while (i < end) {
      byte b = v[i];
      if (b != ' ' && b != '\t' && b != '\n' && b != '\r') break;
      i++;
    }
    return i;
  }

  private static boolean matches(byte[] v, int i, int end, String word) {
    if (end - i < word.length()) return false;
    for (int k = 0; k < word.length(); k++) {
      if (v[i + k] != word.charAt(k)) return false;
    }
    return true;
  }

  /**
   * Scans the string whose opening quote is at i; returns the index after its closing quote,
   * or -1. Leaves {@link #decoded} the text with its escapes resolved (surrogate pairs joined,
   * lone surrogates kept, as generalized UTF-8, so that equal Python strings are equal bytes),
   * or null when it had none.
   */
  private int scanString(byte[] v, int i, int end) {
    decoded = null;
    int from = ++i;
    boolean escaped = false;
    while (true) {
      if (i >= end) return -1;
      byte b = v[i];
      if (b == '"') break;
      if (b >= 0 && b < 0x20) return -1;
      if (b == '\\') {
        escaped = true;
        if (i + 1 >= end) return -1;
        byte e = v[i + 1];
        if (e == 'u') {
          if (i + 5 >= end) return -1;
          for (int k = i + 2; k < i + 6; k++) {
            if (hexDigit(v[k]) < 0) return -1;
          }
          i += 6;
        } else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't') {
          i += 2;
        } else {
          return -1;
        }
      } else {
        i++;
      }
    }
    if (escaped) decoded = unescape(v, from, i);
    return i + 1;
  }

  /** The text of a valid JSON string's body with its escapes resolved, in generalized UTF-8. */
  private static byte[] unescape(byte[] v, int from, int to) {
    byte[] out = new byte[to - from];  // never longer than the escaped form
    int n = 0, i = from;
    while (i < to) {
      byte b = v[i];
      if (b != '\\') {
        out[n++] = b;
        i++;
        continue;
      }
      byte e = v[i + 1];
      if (e != 'u') {
        out[n++] = switch (e) {
          case 'b' -> '\b';
          case 'f' -> '\f';
          case 'n' -> '\n';
          case 'r' -> '\r';
          case 't' -> '\t';
          default -> e;  // " \ /
        };
        i += 2;
        continue;
      }
      int c = hex4(v, i + 2);
      i += 6;
      // json's scanner joins a high surrogate with an escaped low surrogate right after it.
      if (c >= 0xD800 && c <= 0xDBFF && i + 5 < to && v[i] == '\\' && v[i + 1] == 'u') {
        int low = hex4(v, i + 2);
        if (low >= 0xDC00 && low <= 0xDFFF) {
          c = 0x10000 + ((c - 0xD800) << 10) + (low - 0xDC00);
          i += 6;
        }
      }
      n = putCodePoint(out, n, c);
    }
    return java.util.Arrays.copyOf(out, n);
  }

  private static int putCodePoint(byte[] out, int n, int c) {
    if (c < 0x80) {
      out[n++] = (byte) c;
    } else if (c < 0x800) {
      out[n++] = (byte) (0xC0 | (c >> 6));
      out[n++] = (byte) (0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
      out[n++] = (byte) (0xE0 | (c >> 12));
      out[n++] = (byte) (0x80 | ((c >> 6) & 0x3F));
      out[n++] = (byte) (0x80 | (c & 0x3F));
    } else {
      out[n++] = (byte) (0xF0 | (c >> 18));
      out[n++] = (byte) (0x80 | ((c >> 12) & 0x3F));
      out[n++] = (byte) (0x80 | ((c >> 6) & 0x3F));
      out[n++] = (byte) (0x80 | (c & 0x3F));
    }
    return n;
  }

  private static int hex4(byte[] v, int i) {
    return hexDigit(v[i]) << 12 | hexDigit(v[i + 1]) << 8 | hexDigit(v[i + 2]) << 4 | hexDigit(v[i + 3]);
  }

  private static int hexDigit(byte b) {
    if (b >= '0' && b <= '9') return b - '0';
    if (b >= 'a' && b <= 'f') return b - 'a' + 10;
    if (b >= 'A' && b <= 'F') return b - 'A' + 10;
    return -1;
  }

  /**
   * Scans a number at i ({@code -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?}); returns the
   * index after it, or -1 (also for an integer of more than MAX_INT_DIGITS digits). Leaves
   * {@link #scanEnd} -1 for a float, else the integer's end.
   */
  private int scanNumber(byte[] v, int i, int end) {
    if (v[i] == '-') i++;
    if (i >= end) return -1;
    int digits = i;
    if (v[i] == '0') {
      i++;
    } else if (v[i] >= '1' && v[i] <= '9') {
      while (i < end && isDigit(v[i])) i++;
    } else {
      return -1;  // "-" alone, or -Infinity
    }
    int integerDigits = i - digits;
    boolean isFloat = false;
    if (i < end && v[i] == '.') {
      int from = ++i;
      while (i < end && isDigit(v[i])) i++;
      if (i == from) return -1;
      isFloat = true;
    }
    if (i < end && (v[i] == 'e' || v[i] == 'E')) {
      i++;
      if (i < end && (v[i] == '+' || v[i] == '-')) i++;
      int from = i;
      while (i < end && isDigit(v[i])) i++;
      if (i == from) return -1;
      isFloat = true;
    }
    if (!isFloat && integerDigits > MAX_INT_DIGITS) return -1;
    scanEnd = isFloat ? -1 : i;
    return i;
  }

  /** The integer literal text[from, to) into tsInteger if it fits a long. */
  private boolean parseLong(byte[] text, int from, int to) {
    boolean negative = text[from] == '-';
    int i = negative ? from + 1 : from;
    if (to - i > 19) return false;
    long value = 0;  // accumulated negatively: Long.MIN_VALUE has no positive counterpart
    for (; i < to; i++) {
      int d = text[i] - '0';
      if (value < (Long.MIN_VALUE + d) / 10) return false;
      value = value * 10 - d;
    }
    if (!negative) {
      if (value == Long.MIN_VALUE) return false;
      value = -value;
    }
    tsInteger = value;
    return true;
  }

  private static boolean isDigit(byte b) {
    return b >= '0' && b <= '9';
  }

  // -- NGINX --------------------------------------------------------------------------------

  /**
   * records.NGINX_PATTERN, scanned: {@code ip user auth [time] "request" status bytes} and
   * optionally {@code "referer" "agent"}, and nothing after. The pattern has no choice points,
   * so one pass decides it.
   */
  private int scanNginx(byte[] v, int start, int end) {
    int i = start;
    int ipFrom = i;
    for (int field = 0; field < 3; field++) {
      int from = i;
      while (i < end && v[i] != ' ') i++;
      if (i == from || i >= end) return UNRECOGNIZED;
      if (field == 0) {
        ipText = v;
        ipStart = ipFrom;
        ipEnd = i;
      }
      i++;
    }
    if (i >= end || v[i] != '[') return UNRECOGNIZED;
    int timeFrom = ++i;
    while (i < end && v[i] != ']') i++;
    if (i == timeFrom || i >= end) return UNRECOGNIZED;
    tsText = v;
    tsStart = timeFrom;
    tsEnd = i;
    tsKind = STRING;
    i++;
    if ((i = quoted(v, i, end)) < 0) return UNRECOGNIZED;
    if (end - i < 5 || v[i] != ' ' || !isDigit(v[i + 1]) || !isDigit(v[i + 2]) || !isDigit(v[i + 3])
        || v[i + 4] != ' ') {
      return UNRECOGNIZED;
    }
    i += 5;
    if (i < end && v[i] == '-') {
      i++;
    } else {
      int from = i;
      while (i < end && isDigit(v[i])) i++;
      if (i == from) return UNRECOGNIZED;
    }
    if (i == end) return WELL_FORMED;
    if ((i = quoted(v, i, end)) < 0 || (i = quoted(v, i, end)) < 0 || i != end) return UNRECOGNIZED;
    return WELL_FORMED;
  }

  /** ` "…"` (no quote inside) at i; the index after it, or -1. */
  private static int quoted(byte[] v, int i, int end) {
    if (end - i < 3 || v[i] != ' ' || v[i + 1] != '"') return -1;
    i += 2;
    while (i < end && v[i] != '"') i++;
    return i < end ? i + 1 : -1;
  }

  // -- IP addresses -------------------------------------------------------------------------

  /**
   * Python's ipaddress.ip_address, and no "%" (zone id) or non-ASCII: an IPv4 dotted quad
   * (no leading zeros) or any IPv6 form. Leaves {@link #hextets} the IPv6 address's groups.
   */
  private boolean isIp(byte[] a, int from, int to) {
    if (ipv4(a, from, to) >= 0) {
      hextets[0] = -1;  // marks IPv4
      return true;
    }
    return ipv6(a, from, to);
  }

  /** The IPv4 address a[from, to) as an unsigned 32-bit value, or -1. */
  private static long ipv4(byte[] a, int from, int to) {
    long address = 0;
    int i = from;
    for (int octet = 0; octet < 4; octet++) {
      int start = i, value = 0;
      while (i < to && isDigit(a[i])) {
        value = value * 10 + (a[i] - '0');
        if (i - start >= 3) return -1;
        i++;
      }
      int length = i - start;
      if (length == 0 || (length > 1 && a[start] == '0') || value > 255) return -1;
      address = address << 8 | value;
      if (octet < 3) {
        if (i >= to || a[i] != '.') return -1;
        i++;
      }
    }
    return i == to ? address : -1;
  }

  private boolean ipv6(byte[] a, int from, int to) {
    if (from == to) return false;
    int colons = 0;
    for (int i = from; i < to; i++) {
      if (a[i] == ':') colons++;
    }
    if (colons < 2 || colons > 8) return false;  // 3 to 9 parts (an IPv4 tail only adds one)
    int[] partFrom = new int[colons + 1], partTo = new int[colons + 1];
    int parts = 0, start = from;
    for (int i = from; i <= to; i++) {
      if (i == to || a[i] == ':') {
        partFrom[parts] = start;
        partTo[parts++] = i;
        start = i + 1;
      }
    }
    // Groups as values; an IPv4 tail is two of them.
    int[] groups = new int[10];
    boolean[] empty = new boolean[10];
    int n = 0;
    for (int p = 0; p < parts; p++) {
      int pf = partFrom[p], pt = partTo[p];
      if (p == parts - 1 && contains(a, pf, pt, (byte) '.')) {
        long v4 = ipv4(a, pf, pt);
        if (v4 < 0) return false;
        groups[n] = (int) (v4 >> 16);
        empty[n++] = false;
        groups[n] = (int) (v4 & 0xFFFF);
        empty[n++] = false;
        continue;
      }
      empty[n] = pf == pt;
      groups[n++] = empty[n - 1] ? 0 : hextet(a, pf, pt);
    }
    if (n > 9) return false;
    int skip = -1;
    for (int k = 1; k < n - 1; k++) {
      if (empty[k]) {
        if (skip >= 0) return false;
        skip = k;
      }
    }
    int high, low;
    if (skip >= 0) {
      high = skip;
      low = n - skip - 1;
      if (empty[0] && --high != 0) return false;
      if (empty[n - 1] && --low != 0) return false;
      if (8 - (high + low) < 1) return false;
    } else {
      if (n != 8 || empty[0] || empty[n - 1]) return false;
      high = 8;
      low = 0;
    }
    int first = empty[0] && skip >= 0 ? 1 : 0;
    for (int k = 0; k < high; k++) {
      int g = groups[first + k];
      if (g < 0 || empty[first + k]) return false;
      hextets[k] = g;
    }
    for (int k = high; k < 8 - low; k++) hextets[k] = 0;
    int last = empty[n - 1] && skip >= 0 ? n - 2 : n - 1;
    for (int k = 0; k < low; k++) {
      int g = groups[last - low + 1 + k];
      if (g < 0 || empty[last - low + 1 + k]) return false;
      hextets[8 - low + k] = g;
    }
    return true;
  }

  private static boolean contains(byte[] a, int from, int to, byte b) {
    for (int i = from; i < to; i++) {
      if (a[i] == b) return true;
    }
    return false;
  }

  /** 1-4 hex digits as a value, or -1. */
  private static int hextet(byte[] a, int from, int to) {
    if (to - from > 4) return -1;
    int value = 0;
    for (int i = from; i < to; i++) {
      int d = hexDigit(a[i]);
      if (d < 0) return -1;
      value = value << 4 | d;
    }
    return value;
  }

  /** records.canonical_ip into ip: IPv4 as written, IPv6 per RFC 5952, IPv4-mapped as IPv4. */
  private void canonicalIp() {
    if (hextets[0] < 0) {
      ip = ipText;
      ipOffset = ipStart;
      ipLength = ipEnd - ipStart;
      return;
    }
    byte[] out = new byte[39];
    int n = 0;
    if (hextets[0] == 0 && hextets[1] == 0 && hextets[2] == 0 && hextets[3] == 0 && hextets[4] == 0
        && hextets[5] == 0xFFFF) {
      for (int k = 6; k < 8; k++) {
        n = putDecimal(out, n, hextets[k] >> 8);
        out[n++] = '.';
        n = putDecimal(out, n, hextets[k] & 0xFF);
        if (k == 6) out[n++] = '.';
      }
    } else {
      int bestStart = -1, bestLength = 1, runStart = -1;
      for (int k = 0; k < 8; k++) {
        if (hextets[k] != 0) {
          runStart = -1;
          continue;
        }
        if (runStart < 0) runStart = k;
        if (k - runStart + 1 > bestLength) {
          bestLength = k - runStart + 1;
          bestStart = runStart;
        }
      }
      for (int k = 0; k < 8; k++) {
        if (k == bestStart) {
          out[n++] = ':';
          out[n++] = ':';
          k += bestLength - 1;
          continue;
        }
        if (n > 0 && out[n - 1] != ':') out[n++] = ':';
        n = putHex(out, n, hextets[k]);
      }
    }
    ip = out;
    ipOffset = 0;
    ipLength = n;
  }

  private static int putDecimal(byte[] out, int n, int value) {
    if (value >= 100) out[n++] = (byte) ('0' + value / 100);
    if (value >= 10) out[n++] = (byte) ('0' + value / 10 % 10);
    out[n++] = (byte) ('0' + value % 10);
    return n;
  }

  private static int putHex(byte[] out, int n, int value) {
    boolean started = false;
    for (int shift = 12; shift >= 0; shift -= 4) {
      int d = value >> shift & 0xF;
      if (d != 0 || started || shift == 0) {
        out[n++] = (byte) "0123456789abcdef".charAt(d);
        started = true;
      }
    }
    return n;
  }

  // -- event times --------------------------------------------------------------------------

  /**
   * records.parse_iso_time: {@code YYYY-MM-DDTHH:MM:SS(.f{1,9})?(Z|±HH:MM)} naming a real
   * instant (fraction past the ms dropped), or {@link #NONE}.
   */
  static long isoMillis(byte[] t, int from, int to) {
    int n = to - from;
    if (n < 20 || t[from + 4] != '-' || t[from + 7] != '-' || t[from + 10] != 'T' || t[from + 13] != ':'
        || t[from + 16] != ':') {
      return NONE;
    }
    int year = digits(t, from, 4), month = digits(t, from + 5, 2), day = digits(t, from + 8, 2);
    int hour = digits(t, from + 11, 2), minute = digits(t, from + 14, 2), second = digits(t, from + 17, 2);
    if ((year | month | day | hour | minute | second) < 0) return NONE;
    int i = from + 19, millis = 0;
    if (t[i] == '.') {
      int start = ++i;
      while (i < to && isDigit(t[i])) {
        if (i - start < 3) millis = millis * 10 + (t[i] - '0');
        i++;
      }
      int count = i - start;
      if (count == 0 || count > 9) return NONE;
      for (int k = count; k < 3; k++) millis *= 10;
    }
    int offset;
    if (i < to && t[i] == 'Z') {
      offset = 0;
      i++;
    } else {
      if (to - i < 6 || (t[i] != '+' && t[i] != '-') || t[i + 3] != ':') return NONE;
      offset = offsetMinutes(t[i], digits(t, i + 1, 2), digits(t, i + 4, 2));
      if (offset == Integer.MIN_VALUE) return NONE;
      i += 6;
    }
    if (i != to) return NONE;
    long seconds = epochSeconds(year, month, day, hour, minute, second, offset);
    return seconds == NONE ? NONE : seconds * 1000 + millis;
  }

  private static final String MONTHS = "JanFebMarAprMayJunJulAugSepOctNovDec";

  /** records.parse_nginx_time: {@code DD/Mon/YYYY:HH:MM:SS ±HHMM} naming a real instant, or {@link #NONE}. */
  static long nginxMillis(byte[] t, int from, int to) {
    if (to - from != 26 || t[from + 2] != '/' || t[from + 6] != '/' || t[from + 11] != ':' || t[from + 14] != ':'
        || t[from + 17] != ':' || t[from + 20] != ' ' || (t[from + 21] != '+' && t[from + 21] != '-')) {
      return NONE;
    }
    int month = -1;
    for (int m = 0; m < 12; m++) {
      if (t[from + 3] == MONTHS.charAt(3 * m) && t[from + 4] == MONTHS.charAt(3 * m + 1)
          && t[from + 5] == MONTHS.charAt(3 * m + 2)) {
        month = m + 1;
      }
    }
    int day = digits(t, from, 2), year = digits(t, from + 7, 4);
    int hour = digits(t, from + 12, 2), minute = digits(t, from + 15, 2), second = digits(t, from + 18, 2);
    int offsetHours = digits(t, from + 22, 2), offsetMins = digits(t, from + 24, 2);
    if ((month | day | year | hour | minute | second | offsetHours | offsetMins) < 0) return NONE;
    int offset = offsetMinutes(t[from + 21], offsetHours, offsetMins);
    if (offset == Integer.MIN_VALUE) return NONE;
    long seconds = epochSeconds(year, month, day, hour, minute, second, offset);
    return seconds == NONE ? NONE : seconds * 1000;
  }

  /** records.offset_minutes: minutes < 60 and at most 18:00 either way, else Integer.MIN_VALUE. */
  private static int offsetMinutes(byte sign, int hours, int minutes) {
    if (hours < 0 || minutes < 0) return Integer.MIN_VALUE;
    int total = hours * 60 + minutes;
    if (minutes > 59 || total > MAX_OFFSET_MINUTES) return Integer.MIN_VALUE;
    return sign == '+' ? total : -total;
  }

  /** Python's datetime rules (years 1-9999, real days, seconds < 60) in UTC seconds, or NONE. */
  private static long epochSeconds(int year, int month, int day, int hour, int minute, int second, int offset) {
    if (year < 1 || month < 1 || month > 12 || day < 1 || day > daysInMonth(year, month) || hour > 23
        || minute > 59 || second > 59) {
      return NONE;
    }
    return daysFromCivil(year, month, day) * 86_400L + hour * 3_600L + minute * 60L + second - offset * 60L;
  }

  private static int daysInMonth(int year, int month) {
    if (month == 2) return (year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)) ? 29 : 28;
    return (month == 4 || month == 6 || month == 9 || month == 11) ? 30 : 31;
  }

  /** Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm). */
  private static long daysFromCivil(int year, int month, int day) {
    int y = month <= 2 ? year - 1 : year;
    int era = Math.floorDiv(y, 400);
    int yearOfEra = y - era * 400;
    int dayOfYear = (153 * (month + (month > 2 ? -3 : 9)) + 2) / 5 + day - 1;
    int dayOfEra = yearOfEra * 365 + yearOfEra / 4 - yearOfEra / 100 + dayOfYear;
    return era * 146_097L + dayOfEra - 719_468L;
  }

  /** count ASCII digits at i as a number, or -1. */
  private static int digits(byte[] t, int i, int count) {
    int value = 0;
    for (int k = i; k < i + count; k++) {
      if (!isDigit(t[k])) return -1;
      value = value * 10 + (t[k] - '0');
    }
    return value;
  }
}
