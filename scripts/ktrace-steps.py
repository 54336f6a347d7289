#!/usr/bin/env python3
"""One training step of a ktrace CSV, launch by launch, and the difference between two such steps.

  python3 scripts/ktrace-steps.py step TRACE.csv --marker REGEX > STEP.tsv
      The kernels, memsets and copies of the last complete step (between the last two ends of the marker kernel,
      e.g. mt_sgd_f32, which runs once a step), in launch order: index, start offset (us), duration (us), name,
      grid/block. ktrace_report.py gives the totals; this gives each launch, so two runs can be paired.
  python3 scripts/ktrace-steps.py diff A.tsv B.tsv [--top N]
      Pairs the launches of two steps of the same schedule by position (e.g. the bf16 and the fp16 step; names
      compared without their dtype suffix; launches only one step has are listed apart) and prints the step
      times, the kernels whose total differs most, and the single launches that differ most."""
import argparse, collections, csv, difflib, re, sys

DTYPE = re.compile(r"_(bf16|f16|fp16|f32|half|bfloat16)(?=$|_)")


def load_trace(path, marker):
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["kind"] in ("K", "C", "M"):
                rows.append((int(r["start_ns"]), int(r["end_ns"]), r["name"], r["detail"]))
    rows.sort()
    pat = re.compile(marker)
    ends = [e for s, e, n, _ in rows if r_kernel(n) and pat.search(n)]
    if len(ends) < 2:
        sys.exit(f"ktrace-steps: the marker {marker!r} ends fewer than two steps in {path}")
    lo, hi = ends[-2], ends[-1]
    return [(s - lo, e - s, n, d) for s, e, n, d in rows if lo < s and e <= hi]


def r_kernel(name):
    return not name.startswith(("memcpy_kind", "memset"))


def load_step(path):
    out = []
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            i, start, dur, name, grid = line.rstrip("\n").split("\t")
            out.append((float(start), float(dur), name, grid))
    return out


def norm(name):
    return DTYPE.sub("", name)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("step")
    st.add_argument("csv")
    st.add_argument("--marker", default="mt_sgd_f32")
    df = sub.add_parser("diff")
    df.add_argument("a")
    df.add_argument("b")
    df.add_argument("--top", type=int, default=25)
    a = ap.parse_args()

    if a.cmd == "step":
        step = load_trace(a.csv, a.marker)
        print("# index\tstart_us\tdur_us\tname\tgrid/block")
        for i, (s, d, n, g) in enumerate(step):
            print(f"{i}\t{s / 1e3:.1f}\t{d / 1e3:.2f}\t{n}\t{g}")
        return

    sa, sb = load_step(a.a), load_step(a.b)
    # Pair the launches by the longest matching runs of names (difflib): an extra launch in one step (e.g. the
    # fp16 step's overflow check) is listed on its own instead of shifting every later pair.
    sm = difflib.SequenceMatcher(None, [norm(x[2]) for x in sa], [norm(y[2]) for y in sb], autojunk=False)
    pairs, only_a, only_b = [], [], []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            pairs += zip(range(i1, i2), range(j1, j2))
        else:
            only_a += range(i1, i2)
            only_b += range(j1, j2)
    ta, tb = sum(x[1] for x in sa), sum(y[1] for y in sb)
    wa = sa[-1][0] + sa[-1][1]
    wb = sb[-1][0] + sb[-1][1]
    print(f"launches {len(sa)} against {len(sb)}; GPU time {ta / 1e3:.2f} ms against {tb / 1e3:.2f} ms ({tb - ta:+.0f} us); "
          f"step span {wa / 1e3:.2f} against {wb / 1e3:.2f} ms")
    per = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for i, j in pairs:
        k = per[norm(sa[i][2])]
        k[0] += 1
        k[1] += sa[i][1]
        k[2] += sb[j][1]
    print(f"{len(pairs)} launches paired")
    for tag, idx, s_ in (("A", only_a, sa), ("B", only_b, sb)):
        if idx:
            print(f"only in {tag}: {len(idx)} launches, {sum(s_[i][1] for i in idx):.1f} us: "
                  + ", ".join(sorted(set(norm(s_[i][2]) for i in idx)))[:400])
    print(f"\nkernels by total difference (B - A), top {a.top}:")
    print(f"{'launches':>8} {'A us':>10} {'B us':>10} {'B-A us':>9}  kernel")
    for name, (n, xa, xb) in sorted(per.items(), key=lambda kv: -abs(kv[1][2] - kv[1][1]))[: a.top]:
        print(f"{n:>8} {xa:>10.1f} {xb:>10.1f} {xb - xa:>+9.1f}  {name}")
    print(f"\nsingle launches by difference (B - A), top {a.top}:")
    print(f"{'index':>6} {'A us':>9} {'B us':>9} {'B-A us':>8}  kernel  grid/block")
    for i, j in sorted(pairs, key=lambda p: -abs(sb[p[1]][1] - sa[p[0]][1]))[: a.top]:
        print(f"{i:>6} {sa[i][1]:>9.2f} {sb[j][1]:>9.2f} {sb[j][1] - sa[i][1]:>+8.2f}  {norm(sa[i][2])}  "
              f"{sa[i][3]} / {sb[j][3]}")


if __name__ == "__main__":
    main()
