#!/usr/bin/env bash
# A/B of the many-small-tensors figure between two `dckpt` binaries on a noisy machine:
# runs `dckpt bench small --rounds 3` with each binary in turn, N times, and prints the
# medians of every round's save and load seconds (20,000 tensors and one tensor) and the
# ratio of those medians for each binary.
#
#   scripts/ab-small.sh OLD_DCKPT NEW_DCKPT [DIR] [N]
#
# DIR (default target/ab-small) is on the disk under test: /dev/shm/... leaves the disk out.
set -euo pipefail
old=${1:?old dckpt binary}
new=${2:?new dckpt binary}
dir=${3:-target/ab-small}
n=${4:-8}
for _ in $(seq "$n"); do
  DCKPT_BENCH_VERBOSE=1 "$old" bench small --rounds 3 --dir "$dir-a" 2>&1 | sed 's/^/A /'
  DCKPT_BENCH_VERBOSE=1 "$new" bench small --rounds 3 --dir "$dir-b" 2>&1 | sed 's/^/B /'
done | python3 -c '
import re, statistics as st, sys
rounds = {}
for line in sys.stdin:
    m = re.match(r"([AB]) (\d+) tensors: save ([\d.]+) s, load ([\d.]+) s", line)
    if m:
        rounds.setdefault((m[1], m[2]), []).append((float(m[3]), float(m[4])))
med = {k: (st.median(r[0] for r in v), st.median(r[1] for r in v)) for k, v in rounds.items()}
for (ab, n), (s, l) in sorted(med.items()):
    print(f"{ab} {n:>5} tensors: {len(rounds[(ab, n)])} rounds, save {s:.4f} s, load {l:.4f} s")
for ab, name in (("A", "old"), ("B", "new")):
    print(f"{ab} ({name}) ratio of medians {sum(med[(ab, str(1))]) / sum(med[(ab, str(20000))]):.3f}")
'
rm -rf "$dir-a" "$dir-b"
