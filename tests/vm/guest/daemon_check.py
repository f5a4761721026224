#!/usr/bin/python3
"""Reads justitiad's metrics and flow table for tests/vm/guest/daemon-apps.sh.

  daemon_check.py scrape HOST:PORT OUT.json   fetch /metrics, parse it, save the samples
  daemon_check.py value OUT.json SAMPLE       print one sample's value (exit 1: absent)
  daemon_check.py p99 A.json B.json           probe p99 between two scrapes
  daemon_check.py flows FLOWS.json PID...     one line per pid from `justitia flows --json`
  daemon_check.py serve                       the same commands, one per line on stdin, each
                                              answered "ok ANSWER" or "err WHY" on a line

Under emulation, importing the parsers from the read-only 9p root takes seconds; `serve`
pays that once for a whole run.

The exposition is parsed by python3-prometheus-client: by its OpenMetrics parser, which is
strict (it requires "# EOF", suffixes that match each family's type, cumulative buckets),
because the endpoint declares application/openmetrics-text, and by its Prometheus text
parser (prometheus_client.parser), the one a Prometheus-format scraper would use. Both must
accept the text and agree on every sample; the values saved are the text parser's.
A sample is saved as `name{label="value",...}` with its labels sorted, so the shell can
name it exactly; OUT.samples beside it holds them as "NAME<tab>VALUE" lines, and OUT.txt
the raw text.
"""

import json
import math
import sys
import urllib.request

PROBE_HISTOGRAM = "justitia_probe_latency_seconds"


class CheckError(Exception):
    """A check's input is missing or wrong; the message says how."""


def fail(message):
    raise CheckError(message)


def key(name, labels):
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}" if inner else name


def samples(families):
    out = {}
    for family in families:
        for s in family.samples:
            out[key(s.name, s.labels)] = s.value
    return out


def same(a, b):
    """Equal sample sets, a NaN equal to a NaN (Current99 is NaN until probes complete)."""
    if a.keys() != b.keys():
        return False
    return all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def scrape(addr, path):
    # Imported here: the other commands do not need the parsers, and under emulation every
    # import costs time.
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as openmetrics_families,
    )
    from prometheus_client.parser import text_string_to_metric_families as text_families

    try:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as response:
            status = response.status
            content_type = response.headers.get("Content-Type", "")
            text = response.read().decode("utf-8")
    except OSError as e:
        fail(f"fetching http://{addr}/metrics: {e}")
    if not path.endswith(".json"):
        fail(f"{path}: the output's name must end in .json")
    raw = path[: -len(".json")] + ".txt"
    with open(raw, "w", encoding="utf-8") as f:
        f.write(text)
    if status != 200:
        fail(f"status {status} from http://{addr}/metrics")
    try:
        parsed = samples(text_families(text))
    except Exception as e:  # the parser raises ValueError and others on bad text
        fail(f"the Prometheus text parser refused the exposition ({raw}): {e!r}")
    if "openmetrics" in content_type:
        try:
            strict = samples(openmetrics_families(text))
        except Exception as e:
            fail(f"the OpenMetrics parser refused the exposition ({raw}): {e!r}")
        if not same(strict, parsed):
            differ = sorted(set(strict.items()) ^ set(parsed.items()))[:4]
            fail(f"the two parsers disagree on {differ} ({raw})")
    if not parsed:
        fail(f"no sample in the exposition ({raw})")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"content_type": content_type, "samples": parsed}, f, indent=1, sort_keys=True)
    # The same samples as "NAME<tab>VALUE" lines, for the shell to look up without Python.
    with open(path[: -len(".json")] + ".samples", "w", encoding="utf-8") as f:
        for k in sorted(parsed):
            f.write(f"{k}\t{number(parsed[k])}\n")
    return f"{len(parsed)} samples"


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)["samples"]
    except (OSError, ValueError, KeyError) as e:
        fail(f"reading {path}: {e}")


def buckets(s):
    """The probe histogram's cumulative buckets as (upper bound, count), sorted."""
    prefix = PROBE_HISTOGRAM + '_bucket{le="'
    out = []
    for k, v in s.items():
        if k.startswith(prefix):
            out.append((float(k[len(prefix) : -2]), v))
    if not out:
        fail(f"no {PROBE_HISTOGRAM} buckets")
    return sorted(out)


def p99(a_path, b_path):
    """The p99 of the probes completed between two scrapes: the upper bound of the bucket
    holding the sample of rank ceil(0.99 n), from the buckets' differences. Prints
    "P99_SECONDS N"; P99 is inf when that sample is past the last finite bucket."""
    a, b = buckets(load(a_path)), buckets(load(b_path))
    if [le for le, _ in a] != [le for le, _ in b]:
        fail("the two scrapes have different histogram buckets")
    delta = [(le, cb - ca) for (le, ca), (_, cb) in zip(a, b)]
    n = delta[-1][1]
    if n <= 0:
        fail("no probe completed between the two scrapes")
    rank = math.ceil(0.99 * n)
    for le, c in delta:
        if c >= rank:
            return f"{le:g} {n:g}"
    fail("the +Inf bucket holds fewer probes than the rank")


def flows(path, pids):
    """For each pid: "PID CLASS ACTIVE ADMISSION ALLOT_BYTES_PER_SEC" of its flow (the
    allotment "-" when it has none), or "PID absent"."""
    try:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"reading {path}: {e}")
    if not isinstance(table, list):
        fail(f"{path} is not a list of flows")
    lines = []
    for pid in pids:
        mine = [f for f in table if str(f.get("pid")) == pid]
        if not mine:
            lines.append(f"{pid} absent")
            continue
        for f in mine:
            allot = f.get("allot_bytes_per_sec")
            allot = "-" if allot is None else f"{allot:.0f}"
            lines.append(f"{pid} {f['class']} {str(f['active']).lower()} {f['admission']} {allot}")
    return "\n".join(lines)


def value(path, sample):
    s = load(path)
    if sample not in s:
        fail(f"no sample {sample} in {path}")
    return number(s[sample])


def number(v):
    """Integers as integers, so the shell can do arithmetic on counts."""
    return str(int(v)) if float(v).is_integer() else repr(v)


def command(argv):
    """Runs one command; returns its answer."""
    if len(argv) == 3 and argv[0] == "scrape":
        return scrape(argv[1], argv[2])
    if len(argv) == 3 and argv[0] == "value":
        return value(argv[1], argv[2])
    if len(argv) == 3 and argv[0] == "p99":
        return p99(argv[1], argv[2])
    if len(argv) >= 2 and argv[0] == "flows":
        return flows(argv[1], argv[2:])
    fail(f"unknown command {' '.join(argv)!r}; see daemon_check.py's header")


def serve():
    # Arguments never hold spaces (paths under the scratch directories, sample names).
    for line in sys.stdin:
        try:
            answer = command(line.split())
            print("ok " + answer.replace("\n", "; "), flush=True)
        except CheckError as e:
            print(f"err {e}", flush=True)
        except Exception as e:  # an unexpected input must not end the server unanswered
            print(f"err {line.strip()}: {e!r}", flush=True)


def main(argv):
    if argv == ["serve"]:
        serve()
        return
    try:
        print(command(argv))
    except CheckError as e:
        print(f"daemon_check: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
