#!/usr/bin/env python3
"""One training step of a ktrace CSV, launch by launch, and the difference between two such steps.

  python3 scripts/ktrace-steps.py step TRACE.csv --marker REGEX > STEP.tsv
      The kernels, memsets and copies of the last complete step (between the last two ends of the marker kernel,
      e.g. mt_sgd_f32, which runs once a step), in launch order: index, start offset (us), duration (us), name,
      grid/block. ktrace_report.py gives the totals; this gives each launch, so two runs can be paired.
  python3 scripts/ktrace-steps.py diff A.tsv B.tsv [--top N]
      Pairs the launches of two steps of the same schedule by position (e.g. the bf16 and the fp16 step; names
      compared without their dtype suffix; launches only one step has are listed apart) and prints the step
      times, the kernels whose total differs most, and the single launches that differ most.
  python3 scripts/ktrace-steps.py bn STEP.tsv [--arch resnet152] [--batch 256] [--elem 2] [--ref-tbs R] [--mask]
      The BatchNorm launches of a fused bottleneck-ResNet step (the cooperative kernels: bn_nhwc_train_v8,
      train2_v8, train_bwd_v8, train_join_bwd_{1,2}_v8) against the bytes each must move: the step's schedule is
      rebuilt from the architecture, each launch is matched to its layer by position (the kind of kernel checked
      at every position; the stem's kernels fused with its max-pool are recognised), and the passes over its
      tensors are counted (a moments pass, the normalisation's read and write, ...). Prints the achieved TB/s per (kernel, stage) and the time each group would take at R TB/s
      (default: the best group's rate), so the launches that lose time to fixed costs stand out."""
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


# Bottleneck ResNets (torchvision v1.5: the stride on the 3x3 conv): blocks per stage.
BOTTLENECK = {"resnet50": (3, 4, 6, 3), "resnet101": (3, 4, 23, 3), "resnet152": (3, 8, 36, 3)}


def bn_schedule(arch, n, elem, mask=False):
    """The cooperative BatchNorm launches of one fused step in launch order: (label, {kernel kind: bytes it must
    move}). Forward: the stem (moments, read, write: 3 passes; fused with its max-pool, train_pool: moments and one
    read, then the pooled output and its offsets), each block's bn1 and bn2 (3 passes, bn1 at the block input's
    resolution), then its output: relu(bn3(x) + shortcut) as train_v8 with the residual (moments of x; read x and
    the shortcut, write: 4 passes) or, in a downsample block, train2 (moments of x and of the shortcut conv's
    output r; read both, write: 5 passes). Backward, last block first: the output's ReLU gradient with bn3's
    backward (join_bwd_2 reads a, b, y, x, writes g, then reads x, g, writes dx: 8 passes; join_bwd_1, the last
    block, has no b: 7), bn2 and bn1 (read x, dy; read x, dy, write dx: 5), a downsample block's shortcut
    BatchNorm (5), and last the stem's (5; fused with the pool's backward, train_bwd_pool: x twice, dx, and the
    two pooled gradients with the offsets in both passes). With mask (KERNELS_JOIN_MASK=1: the block outputs' ReLU
    masks) the block outputs' forwards also write 1/16 of the output (one bit an element at 2 bytes) and the
    joins read that instead of y. A join whose shortcut gradient comes from the next block's 1x1 stride-2
    downsample may be join_bwd_2s (KERNELS_COMPACT_SHORTCUT=1): it reads that gradient on the downsample's grid,
    a quarter of the output."""
    stem, pooled = n * 112 * 112 * 64, n * 56 * 56 * 64
    fwd = [("stem", {"train": 3 * stem * elem, "train_pool": 2 * stem * elem + pooled * (elem + 1)})]
    bwd = []
    res_in = 56
    blocks = []
    for si, count in enumerate(BOTTLENECK[arch]):
        c, res = 64 << si, 56 >> si
        for b in range(count):
            blocks.append((f"layer{si + 1}", c, res_in if b == 0 else res, res, b == 0))
        res_in = res
    for stage, c, rin, res, ds in blocks:
        fwd.append((f"{stage} bn1", {"train": 3 * n * rin * rin * c * elem}))
        fwd.append((f"{stage} bn2", {"train": 3 * n * res * res * c * elem}))
        out = n * res * res * 4 * c * elem
        m = out / (8 * elem) if mask else 0
        fwd.append((f"{stage} out+ds", {"train2": 5 * out + m}) if ds else (f"{stage} out", {"train": 4 * out + m}))
    strided_next = False  # whether the block after this one (in forward order) has a stride-2 downsample
    for i, (stage, c, rin, res, ds) in enumerate(reversed(blocks)):
        out = n * res * res * 4 * c * elem
        gate = out / (8 * elem) if mask else out  # the mask's bytes or y's
        if i == 0:
            bwd.append((f"{stage} out", {"join_bwd_1": 6 * out + gate}))
        else:
            kinds = {"join_bwd_2": 7 * out + gate}
            if strided_next:
                kinds["join_bwd_2s"] = 6 * out + out / 4 + gate
            bwd.append((f"{stage} out", kinds))
        strided_next = ds and rin != res
        bwd.append((f"{stage} bn2", {"train_bwd": 5 * n * res * res * c * elem}))
        bwd.append((f"{stage} bn1", {"train_bwd": 5 * n * rin * rin * c * elem}))
        if ds:
            bwd.append((f"{stage} ds", {"train_bwd": 5 * out}))
    bwd.append(("stem", {"train_bwd": 5 * stem * elem, "train_bwd_pool": 3 * stem * elem + 2 * pooled * (2 * elem + 1)}))
    return fwd + bwd


def bn_kind(name):
    m = re.match(r"bn_nhwc_(train_join_bwd_(?:1|2s|2)|train_bwd_pool|train_bwd|train_pool|train2|train)_v8_", name)
    if not m:
        return None
    return m.group(1).replace("train_join_bwd", "join_bwd")


def bn_report(step, arch, batch, elem, ref, mask=False):
    launches = [(d, n) for _, d, n, _ in step if bn_kind(n)]
    want = bn_schedule(arch, batch, elem, mask)
    if len(launches) != len(want):
        sys.exit(f"ktrace-steps bn: {len(launches)} BatchNorm launches in the step, the {arch} schedule has "
                 f"{len(want)} (another architecture, or not the cooperative path?)")
    groups = collections.OrderedDict()
    per_kind = collections.defaultdict(list)
    for i, ((dur, name), (label, kinds)) in enumerate(zip(launches, want)):
        kind = bn_kind(name)
        if kind not in kinds:
            sys.exit(f"ktrace-steps bn: BatchNorm launch {i} is {name}, the schedule expects "
                     f"{' or '.join(kinds)} ({label})")
        by = kinds[kind]
        per_kind[kind].append((by, dur))
        stage = label.split()[0]
        part = label.split()[1] if " " in label else ""
        key = (kind, stage, "inner" if part in ("bn1", "bn2") else part or "stem")
        g = groups.setdefault(key, [0, 0.0, 0.0])
        g[0] += 1
        g[1] += dur
        g[2] += by
    rates = {k: v[2] / (v[1] * 1e-6) / 1e12 for k, v in groups.items()}
    ref = ref or max(rates.values())
    total = sum(v[1] for v in groups.values())
    at_ref = sum(v[2] / (ref * 1e12) * 1e6 for v in groups.values())
    print(f"BatchNorm launches: {len(launches)}, {total / 1e3:.2f} ms; {sum(v[2] for v in groups.values()) / 1e9:.1f}"
          f" GB moved; at {ref:.2f} TB/s: {at_ref / 1e3:.2f} ms ({(total - at_ref) / 1e3:.2f} ms lost)")
    print(f"{'kernel':<15}{'stage':<8}{'part':<8}{'launches':>9}{'us each':>9}{'ms':>8}{'MB each':>9}{'TB/s':>7}"
          f"{'lost ms':>9}")
    for (kind, stage, part), (cnt, us, by) in groups.items():
        lost = (us - by / (ref * 1e12) * 1e6) / 1e3
        print(f"{kind:<15}{stage:<8}{part:<8}{cnt:>9}{us / cnt:>9.1f}{us / 1e3:>8.2f}{by / cnt / 1e6:>9.1f}"
              f"{rates[(kind, stage, part)]:>7.2f}{lost:>9.2f}")
    # Least squares of each kernel's launches: duration = F + bytes / B (F: the fixed cost of a launch, its
    # barriers and finaliser; B: the rate of its passes).
    print("fit per kernel: duration = F + bytes / B")
    for kind, pts in per_kind.items():
        n = len(pts)
        if n < 3 or len({b for b, _ in pts}) < 2:
            continue
        mb, md = sum(b for b, _ in pts) / n, sum(d for _, d in pts) / n
        sxx = sum((b - mb) ** 2 for b, _ in pts)
        slope = sum((b - mb) * (d - md) for b, d in pts) / sxx
        f = md - slope * mb
        print(f"  {kind:<15} {n:>4} launches  F = {f:6.1f} us  B = {1e-6 / slope:5.2f} TB/s  "
              f"(F x launches = {f * n / 1e3:.2f} ms)")


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
    bn = sub.add_parser("bn")
    bn.add_argument("step")
    bn.add_argument("--arch", default="resnet152", choices=sorted(BOTTLENECK))
    bn.add_argument("--batch", type=int, default=256)
    bn.add_argument("--elem", type=int, default=2, help="bytes per activation element (2: bf16 / fp16)")
    bn.add_argument("--ref-tbs", type=float, default=None)
    bn.add_argument("--mask", action="store_true", help="the step ran with KERNELS_JOIN_MASK=1 (ReLU masks)")
    a = ap.parse_args()

    if a.cmd == "bn":
        bn_report(load_step(a.step), a.arch, a.batch, a.elem, a.ref_tbs, a.mask)
        return

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
