"""Record values that hold a parser to the format's specification (ipcount.rules.records):
hand-picked edges, generated traffic and random mutations of it, with Kafka timestamps that
reach every reason. Shared by the Spark parity test and the JVM parser's Spark-free one."""
from __future__ import annotations

import random

from ipcount.rules.records import Event, parse_value
from ipcount_lab.generator import MALFORMED_SAMPLES, TrafficGenerator

HAND_PICKED = [
    b'{"ip": "203.0.113.9", "ts": "2026-11-21T10:00:03.120Z"}',
    b'{"ip": "2001:DB8::A", "ts": "2026-11-21T11:00:03.5+01:00"}',
    b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03.987654321Z"}',
    b'  {"ip": "1.2.3.4", "ts": 1795255203120}\n',
    b'{"ip": "1.2.3.4", "ts": 1795255203000.5}', b'{"ip": "1.2.3.4", "ts": 1e12}', b'{"ip": "1.2.3.4", "ts": true}',
    b'{"ip": "1.2.3.4", "ts": 99999999999999999999}', b'{"ip": "1.2.3.4", "ts": -5}',
    b'{"ip": "1.2.3.4", "ts": "1795255203000"}', b'{"ip": "1.2.3.4", "ts": "2026-02-30T00:00:00Z"}',
    b'{"ip": "1.2.3.4", "ts": "2026-11-21T24:00:00Z"}', b'{"ip": "1.2.3.4", "ts": "1999-12-31T23:59:59Z"}',
    b'{"ip": "1.2.3.4", "ip": "5.6.7.8", "ts": 1795255203000}', b'{"ip": "1.2.3.4", "ts": 1} trailing',
    # the whole-value check: one "}" at the end, a "}" inside a string, text after the object
    b'{"ip": "1.2.3.4", "ts": 1795255203000, "x": "a}b"}', b'{"ip": "1.2.3.4", "ts": 1795255203000}}',
    b'{"ip": "1.2.3.4", "ts": 1795255203000} {"ip": "5.6.7.8", "ts": 1795255203000}',
    b'{"ip": "1.2.3.4", "ts": 1795255203000}, 0], [0', b'{"ip": "1.2.3.4", "ts": 1795255203000}]',
    b'{"ip": "1.2.3.4\x01", "ts": 1795255203000}', b'{"ip": "1.2.3.4", "ts": NaN}', b'{"ip": "1.2.3.4", "ts": 01}',
    b'{"ip": null, "ts": 1795255203000}', b'{"ts": 1795255203000}', b'{}', b'{', b'{"a": [1, 2}',
    b'["1.2.3.4", 1795255203000]', b'"1.2.3.4"',
    # Nesting: 999 levels (the record's object included) parse, 1,000 and 30,000 do not.
    *(b'{"ip": "1.2.3.4", "ts": 1795255203000, "x": ' + o * (d - 1) + b'1' + c * (d - 1) + b'}'
      for d in (999, 1000, 30_000) for o, c in ((b'[', b']'), (b'{"a": ', b'}'))),
    b'{"ip": "1.2.3.4", "ts": 1795255203000, "x": "' + b'[' * 2000 + b'"}',
    *(b'{"ip": ' + b'[' * (d - 1) + b'1' + b']' * (d - 1) + b', "ts": 1795255203000}' for d in (999, 1000)),
    b'{"ip": "1.2.3.4", "ts": ' + b'{"a": ' * 998 + b'1' + b'}' * 998 + b'}',
    b'203.0.113.9 - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512 "-" "curl/8"',
    b'203.0.113.9 - frank [21/Nov/2026:11:00:03 +0100] "POST /x HTTP/2.0" 404 -',
    b'::1 - - [21/Nov/2026:10:00:03 -0130] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [31/Feb/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/NOV/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03] "GET / HTTP/1.1" 200 512',
    b'01.2.3.4 - - [21/Nov/2026:10:00:03 +0000] "G" 200 1',
    b'fe80::1%eth0 - - [21/Nov/2026:10:00:03 +0000] "G" 200 1', b"GET / 200", b"   ", b"\t\r\n", b"",
    b"\xff\xfe\xfd", b"\xc3\x28", b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03Z", "x": "\xe2\x82\xac"}',
    b"x" * 70_000, None,
    # time-zone offsets: java.time's limits (minutes < 60, at most 18:00 either way) hold in both
    b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03+18:00"}', b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03-18:00"}',
    b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03+18:01"}', b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03+19:00"}',
    b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03+05:99"}', b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03-05:60"}',
    b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03+23:59"}', b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03+05:45"}',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +1800] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 -1801] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +1900] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0599] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0560] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0545] "GET / HTTP/1.1" 200 512',
    # one address, many spellings: all counted as its canonical form
    b'{"ip": "2001:0db8:0000::1", "ts": 1795255203000}', b'{"ip": "2001:DB8:0:0:0:0:0:1", "ts": 1795255203000}',
    b'{"ip": "::ffff:1.2.3.4", "ts": 1795255203000}', b'{"ip": "::FFFF:0102:0304", "ts": 1795255203000}',
    b'{"ip": "::1.2.3.4", "ts": 1795255203000}', b'{"ip": "1:0:0:1:0:0:0:1", "ts": 1795255203000}',
    b'{"ip": "0:0:1:0:0:1:0:0", "ts": 1795255203000}', b'{"ip": "1:0:3:4:5:6:7:8", "ts": 1795255203000}',
    b'::ffff:10.0.0.1 - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512',
    # ISO times read by Spark's cast: fraction digits past the microsecond, leap seconds,
    # impossible dates, year 0, zero offsets
    *(b'{"ip": "1.2.3.4", "ts": "%s"}' % t for t in (
        b"2026-11-21T10:00:03.1234567Z", b"2026-11-21T10:00:03.0009Z", b"2026-11-21T10:00:03.999999999-00:00",
        b"2026-11-21T23:59:60Z", b"2026-13-01T00:00:00Z", b"2026-00-10T00:00:00Z", b"2026-11-00T00:00:00Z",
        b"2028-02-29T00:00:00Z", b"2027-02-29T00:00:00Z", b"0000-01-01T00:00:00Z", b"2026-11-21T10:60:00+00:00",
        b"2026-11-21T10:00:03.Z", b"2026-11-21T10:00:03,5Z", b"2026-11-21t10:00:03Z", b"2026-11-21T10:00:03z")),
    # Line terminators at the end: Java's "$" matches before a final \n, \r, U+0085, U+2028 or U+2029
    b'{"ip":"1.2.3.4","ts":1795255203000}\xe2\x80\xa8', b'{"ip":"1.2.3.4","ts":1795255203000}\xc2\x85',
    b'{"ip": "1.2.3.4\\n", "ts": 1795255203000}', b'{"ip": "::1\\r", "ts": 1795255203000}',
    b'{"ip": "1.2.3.4\\u2028", "ts": 1795255203000}', b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03Z\\r"}',
    b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03Z\\n"}', b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03Z\\u2029"}',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512\xe2\x80\xa9',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0000\xe2\x80\xa8] "GET / HTTP/1.1" 200 512',
    # a record from a bad clock, far ahead of its Kafka timestamp
    b'{"ip": "1.2.3.4", "ts": 4102444700000}',
]


def mutations(rng: random.Random, values: list[bytes]) -> list[bytes]:
    out = []
    for v in values:
        for _ in range(3):
            b = bytearray(v)
            op = rng.randrange(3)
            if op == 0 and b:
                b[rng.randrange(len(b))] = rng.randrange(256)
            elif op == 1 and b:
                del b[rng.randrange(len(b)):]
            else:
                b.insert(rng.randrange(len(b) + 1), rng.choice(b' {}":,-[]0aZ\\'))
            out.append(bytes(b))
    return out


NO_TS = [b'{"ip": "203.0.113.9"}', b'{"ip": "203.0.113.9", "ts": [1]}', b'{"ts": 1795255203000}',
         b'203.0.113.9 - - [99/Xyz/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512']


# What a parser of its own has to get right where Spark's functions did it for us: Python's
# json (limits, escapes, duplicates at any depth), ipaddress and datetime.
_TS = b'"ts": 1795255203000'
EDGES = [
    *(b'{"ip": "1.2.3.4", ' + _TS + b', "n": ' + sign + b'1' * digits + b'}'
      for digits in (4300, 4301) for sign in (b"", b"-")),
    b'{"ip": "1.2.3.4", ' + _TS + b', "n": ' + b'1' * 5000 + b'.5}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "n": 1e999}', b'{"ip": "1.2.3.4", ' + _TS + b', "n": -0}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "n": -}', b'{"ip": "1.2.3.4", ' + _TS + b', "n": 1.}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "n": .5}', b'{"ip": "1.2.3.4", ' + _TS + b', "n": 1e}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "n": -Infinity}', b'{"ip": "1.2.3.4", ' + _TS + b', "n": Infinity}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "n": +1}', b'{"ip": "1.2.3.4", ' + _TS + b', "n": 0x1}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "n": [true, false, null, tru]}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "n": nulll}', b'{"ip": "1.2.3.4", ' + _TS + b',}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "n": [1,]}', b'{"ip": "1.2.3.4", ' + _TS + b', "n": [,1]}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "n": {}, "m": [], "o": [{}, [[]]]}',
    b'{"ip": "1.2.3.4" ' + _TS + b'}', b'{"ip" "1.2.3.4", ' + _TS + b'}', b'{ip: "1.2.3.4", ' + _TS + b'}',
    b'{"ip": "1.2.3.4", ' + _TS + b'}\x0b', b'{"ip": "1.2.3.4", ' + _TS + b'}\x0c',
    b'{"ip": "1.2.3.4",\x0b' + _TS + b'}', b'{\t"ip"\r:\n"1.2.3.4" ,' + _TS + b' }',
    # escapes: in keys (duplicates after unescaping), in the ip and the ts
    b'{"i\\u0070": "1.2.3.4", ' + _TS + b'}', b'{"i\\u0070": "1.2.3.4", "ip": "1.2.3.4", ' + _TS + b'}',
    b'{"ip": "1.2.3.\\u0034", ' + _TS + b'}', b'{"ip": "1.2.3.4", "ts": "2026-11-21T10:00:03\\u005a"}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "\\ud800\\udc00": 1, "\xf0\x90\x80\x80": 2}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "\\ud800": 1, "\\udc00": 2, "\\ud800\\u0041": 3}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "\\uD83D\\uDE00": 1, "\\ud83d\\ude00": 2}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "a\\/b": 1, "a/b": 2}', b'{"ip": "1.2.3.4", ' + _TS + b', "a\\x": 1}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "a\\u12G4": 1}', b'{"ip": "1.2.3.4", ' + _TS + b', "a\\u12": 1}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "t\\tb\\bf\\fn\\nr\\r\\"\\\\": 1}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "a\x7fb": "\xe2\x80\xa8"}', b'{"ip": "1.2.3.4", ' + _TS + b', "a\x1fb": 1}',
    b'{"ip": "\\u0031.2.3.4\\u0000", ' + _TS + b'}',
    # duplicates: nested objects have keys of their own; many keys take the hashed check
    b'{"ip": "1.2.3.4", ' + _TS + b', "a": {"ip": 1, "ts": 2}, "b": {"a": 1}}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "a": {"x": 1, "x": 2}}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "a": [{"x": 1}, {"x": 1}]}',
    b'{"ip": "1.2.3.4", ' + _TS + b', "a": {"b": {}}, "b": 1}',
    *(b'{"ip": "1.2.3.4", ' + _TS + b', ' + b", ".join(b'"k%d": %d' % (k, k) for k in range(n)) + extra + b'}'
      for n in (15, 16, 17, 40) for extra in (b"", b', "k3": 0', b', "k%d": 0' % (n - 1), b', "ip": "5.6.7.8"')),
    # the top-level ip and ts: kinds, a nested "ip" that is not the record's
    b'{"a": {"ip": "1.2.3.4", ' + _TS + b'}}', b'{"ip": {"ip": "1.2.3.4"}, ' + _TS + b'}',
    b'{"ip": ["1.2.3.4"], ' + _TS + b'}', b'{"ip": 1234, ' + _TS + b'}', b'{"ip": true, ' + _TS + b'}',
    b'{"ip": "1.2.3.4", "ts": 9223372036854775807}', b'{"ip": "1.2.3.4", "ts": 9223372036854775808}',
    b'{"ip": "1.2.3.4", "ts": -9223372036854775808}', b'{"ip": "1.2.3.4", "ts": -9223372036854775809}',
    b'{"ip": "1.2.3.4", "ts": 1795255203000.0}', b'{"ip": "1.2.3.4", "ts": 17952552030e2}',
    b'{"ip": "1.2.3.4", "ts": null}', b'{"ip": "1.2.3.4", "ts": {}}', b'{"ip": "1.2.3.4", "ts": "x"}',
    # IPv6 forms, invalid and valid, and their canonical text
    *(b'{"ip": "%s", ' % ip + _TS + b'}' for ip in (
        b"::", b"::0", b"0::", b"::0.0.0.0", b"::ffff:0.0.0.0", b"1::", b"::1", b"1:2:3:4:5:6:7::", b"::2:3:4:5:6:7:8",
        b"1::2:3:4:5:6:7:8", b"1:2:3:4:5:6:7:8:9", b"1:2:3:4:5:6:7:8", b"1:2:3:4:5:6:7", b":1:2:3:4:5:6:7:8",
        b"1:2:3:4:5:6:7:8:", b"1::2::3", b":::", b"1:::2", b"::1:2:3:4:5:6:7", b"1:2:3:4:5:6::7", b"12345::1",
        b"1:2:3:4:5:6:1.2.3.4", b"1:2:3:4:5:6:7:1.2.3.4", b"::1.2.3.4.5", b"::1.2.3", b"::01.2.3.4", b"1.2.3.4::",
        b"::1.2.3.4:5", b"0:0:0:0:0:ffff:1.2.3.4", b"::FFFF:abcd:EF01", b"fe80::1%eth0", b"1:0:0:2:0:0:0:3",
        b"1:0:0:2:0:0:3:4", b"0:0:1:0:0:0:1:0", b"abcd:0:0:0:0:0:0:0", b"0000:0000::0001", b"1:2:3:4:5:6:7:0",
        b"\xc2\xb9::1", b"1.2.3.4 ", b" 1.2.3.4", b"1.2.3", b"1.2.3.4.5", b"256.1.1.1", b"255.255.255.255", b"0.0.0.0",
        b"00.1.1.1", b"1.2.3.04", b"1234.1.1.1", b"1..3.4", b"1.2.3.", b".1.2.3", b"", b":", b"::%", b"a:b:c")),
    # times: leap days, the last valid instant, year 9999, offsets at their limits
    *(b'{"ip": "1.2.3.4", "ts": "%s"}' % t for t in (
        b"2000-02-29T00:00:00Z", b"2100-02-29T00:00:00Z", b"2000-01-01T00:00:00Z", b"1999-12-31T23:59:59.999Z",
        b"2099-12-31T23:59:59.999999999Z", b"2100-01-01T00:00:00Z", b"2099-12-31T23:59:59-00:01",
        b"2000-01-01T00:00:00+00:01", b"9999-12-31T23:59:59Z", b"2026-04-31T00:00:00Z", b"2026-11-21T10:00:03.Z",
        b"2026-11-21T10:00:03.1234567890Z", b"2026-11-21T10:00:03+05:30x", b"2026-11-21T10:00:03+0530",
        b"2026-11-21T10:00:03", b"2026-1-21T10:00:03Z", b"+2026-11-21T10:00:03Z", b"2026-11-21T10:00:03.5+18:00")),
    *(b'1.2.3.4 - - [%s] "GET / HTTP/1.1" 200 512' % t for t in (
        b"29/Feb/2028:10:00:03 +0000", b"29/Feb/2027:10:00:03 +0000", b"00/Nov/2026:10:00:03 +0000",
        b"31/Apr/2026:10:00:03 +0000", b"21/Nov/2026:24:00:00 +0000", b"21/Nov/2026:23:60:00 +0000",
        b"21/Nov/2026:23:59:60 +0000", b"21/Nov/0000:10:00:03 +0000", b"21/Sept/2026:10:00:03 +0000",
        b"21/nov/2026:10:00:03 +0000", b"21/Nov/2026:10:00:03 +00:00", b"21/Nov/2026:10:00:03  +0000",
        b"01/Jan/2000:00:00:00 +0000", b"31/Dec/1999:23:59:59 +0000", b"01/Jan/2000:00:59:59 +0100",
        b"1/Nov/2026:10:00:03 +0000", b"21/Nov/2026:10:00:03 +0000 ", b"21/Nov/2026:10:00:03 \xe2\x82\xac000")),
    # NGINX lines: every piece of the pattern missing or doubled
    b'1.2.3.4  - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0000]  "GET / HTTP/1.1" 200 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 2000 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 20 512',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 --',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 5x',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512 "-"',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512 "-" "a" ',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0000] "GET / HTTP/1.1" 200 512 "" ""',
    b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0000] "" 200 -', b'1.2.3.4 - - [] "GET /" 200 1',
    b'1.2.3.4 - - [[21/Nov/2026:10:00:03 +0000] "GET /" 200 1', b'1.2.3.4 - [x [21/Nov/2026:10:00:03 +0000] "G" 200 1',
    b'1.2.3.4\t- - [21/Nov/2026:10:00:03 +0000] "G" 200 1', b'1.2.3.4 - - [21/Nov/2026:10:00:03 +0000] "G" 200 1\t',
    # UTF-8 as Python decodes it: no overlongs, encoded surrogates or code points past U+10FFFF
    *(b'{"ip": "1.2.3.4", ' + _TS + b', "x": "' + seq + b'"}' for seq in (
        b"\xed\x9f\xbf", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xee\x80\x80", b"\xe0\xa0\x80", b"\xe0\x9f\xbf",
        b"\xc0\x80", b"\xc1\xbf", b"\xc2\x80", b"\xf0\x90\x80\x80", b"\xf0\x8f\xbf\xbf", b"\xf4\x8f\xbf\xbf",
        b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xbf", b"\xe2\x82",
        b"\xf0\x9f\x98")),
    b'1.2.3.4 - -', b'1.2.3.4', b'{', b'{ ', b' {"ip": "1.2.3.4", ' + _TS + b'} ',
]


# Small objects, some one character away from the common {"ip", "ts"} shape.
SMALL_JSON = [
    '{"ip": "1.2.3.4", "ts": 1795255203000}', '{"ts":"2026-11-21T10:00:03Z","ip":"::1"}',
    '{ \t"ip"\n:\r"2001:DB8::A" ,\t"ts" :  123456789012345678 }', '{"ip": "1.2.3.4", "ts": 1234567890123456789}',
    '{"ip": "1.2.3.4", "ts": 0}', '{"ip": "1.2.3.4", "ts": -5}', '{"ip": "1.2.3.4", "ts": 01}', '{"ip": "", "ts": 1}',
    '{"ip": "1.2.3.4", "ts": ""}', '{"ip": "1.2.3.4", "ip": "1.2.3.4"}', '{"ts": 1, "ts": 2}', '{"ip": "1.2.3.4"}',
    '{"ip": "1.2.3.4", "ts": 1, "x": 2}', '{"ip": "1.2.3.4", "ts": 1.5}', '{"ip": "1.2.3.4", "ts": 1e3}',
    '{"ip": "1.2.3.4", "ts": "a\\"b"}', '{"ip": "1.2.3.4", "ts": "é"}', '{"i\\u0070": "1.2.3.4", "ts": 1}',
    '{"ip": "1.2.3.4" "ts": 1}', '{"ip": "1.2.3.4", "ts": 1}}', '{"ip": "1.2.3.4", "ts": 1} ',
    '{"IP": "1.2.3.4", "ts": 1}',
]


def ip_texts(seed: int = 3) -> list[str]:
    """IP address texts, valid and not, as ipaddress would see them: every IPv6 form, and
    random groups, octets and embedded IPv4 tails."""
    rng = random.Random(seed)
    samples = ["::", "::1", "1::", "1:2:3:4:5:6:7:8", "1:2:3:4:5:6:7::", "::2:3:4:5:6:7:8", "1::8",
               "::ffff:1.2.3.4", "1:2:3:4:5:6:1.2.3.4", "1::1.2.3.4", "::1.2.3.4", "1:2:3:4:5:6:7:8:9",
               "1::2::3", ":1::", "1:2:3:4:5:6:7", "12345::", "1.2.3", "1.2.3.4.5", "0.0.0.0",
               "255.255.255.255", "1.2.3.04", "1:2:3:4:5::1.2.3.4", "1:2:3:4:5:6:7:1.2.3.4", "g::1", "",
               "01.2.3.4", "1.2.3.4.", ".1.2.3.4", "1..2.3", "1.2.3.4 ", "a.b.c.d"]
    for _ in range(3000):
        groups = [f"{rng.randrange(0, 1 << rng.choice((4, 8, 16))):x}" for _ in range(rng.randint(1, 9))]
        if rng.random() < 0.5:
            groups.insert(rng.randrange(len(groups) + 1), "")
        text = ":".join(groups)
        if rng.random() < 0.2:
            text += ":" + ".".join(str(rng.randrange(0, 300)) for _ in range(4))
        samples.append(text.upper() if rng.random() < 0.2 else text)
        samples.append(".".join(str(rng.choice((0, 1, 9, 10, 99, 100, 199, 200, 249, 250, 255, 256)))
                                for _ in range(rng.choice((3, 4, 4, 4, 5)))))
    return samples


def values(seed: int = 5, generated: int = 3000) -> list[bytes | None]:
    """Every case above, IP texts in JSON records, generated traffic (a few percent malformed) and three random
    mutations of each of its first 400 records."""
    traffic = [r.value for r in TrafficGenerator(seed=seed, malformed_share=0.05).records(generated, START_MS)]
    ips = [b'{"ip": "%s", "ts": %d}' % (ip.encode(), START_MS) for ip in ip_texts()]
    out = (HAND_PICKED + EDGES + [t.encode() for t in SMALL_JSON] + ips + NO_TS + [v for _, v in MALFORMED_SAMPLES]
           + traffic)
    return out + mutations(random.Random(9), [v for v in traffic[:400] if v])


START_MS = 1_795_255_203_000
HOUR_MS = 3_600_000
PLANNED_AT_MS = START_MS + 2 * HOUR_MS  # the epoch's planning time in these cases


def kafka_timestamps(count: int, seed: int = 4) -> list[int]:
    """Kafka timestamps: mostly plausible, some outside the valid event-time range, some
    hours before the payload's time or after the planning time (event_time_ahead)."""
    rng = random.Random(seed)
    return [rng.choice((START_MS + rng.randrange(-10**6, 10**6), START_MS + rng.randrange(-10**6, 10**6),
                        631_152_000_000, 4_200_000_000_000, START_MS - 3 * HOUR_MS, PLANNED_AT_MS + HOUR_MS + 1))
            for _ in range(count)]


def expected(value: bytes | None, kafka_ms: int, event_time: str) -> tuple[str | None, str | None, int | None]:
    """(reason, ip, event_ms) by the specification, with the cases' planning time and a cap
    of an hour ahead."""
    p = parse_value(value, 65_536, event_time=event_time, kafka_timestamp_ms=kafka_ms, planned_at_ms=PLANNED_AT_MS,
                    max_ahead_ms=HOUR_MS)
    return (None, p.ip, p.event_ms) if isinstance(p, Event) else (p.reason, None, None)
