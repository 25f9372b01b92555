"""A/B timing of fdlib's kernels in several source trees, at fixed split counts.

    python tools/ab_kernels.py OUT.json LABEL=TREE [LABEL=TREE ...] [--methods unified,split]
        [--shapes B:H_q:H_kv:D:L:splits,...]

``--methods``: plan methods (default unified and split, at the shape's split count); ``invariant`` plans with
``batch_invariant=True`` (``invariant@K``: that plan with K chunks a program, its schedule rule overridden;
K >= the row's most chunks is the ALONE kernel), ``auto`` with the cost model's choice, ``persistent`` and
``streamk`` at one split (their split counts are ignored).

Each tree (a checkout of some commit) is imported in its own process; every shape is timed with the same
protocol: a CUDA graph of 24 calls rotating over copies of q/K/V totalling >= 4x the L2, replayed 40 times,
median of 5 such measurements, µs per call; the JSON carries the device, versions, date, command and trees.
Used to find which commit changed a kernel's time.
"""
import json
import os
import subprocess
import sys

SHAPES = [  # B, H_q, H_kv, D, L, splits
    (1, 32, 8, 128, 512, 8), (1, 32, 8, 128, 2048, 11), (1, 32, 8, 128, 8192, 16), (1, 32, 8, 128, 8192, 13),
    (1, 32, 32, 128, 2048, 4), (16, 32, 8, 128, 512, 1), (64, 32, 32, 128, 512, 1),
]

CHILD = r'''
import json, sys, torch, fdlib
shapes = json.loads(sys.argv[1])
dev = "cuda"
res = []
methods = json.loads(sys.argv[2])
for (B, Hq, Hkv, D, L, S) in shapes:
    for method in methods:
        g = torch.Generator(device=dev).manual_seed(0)
        per = 2 * B * L * Hkv * D * 2
        n = max(2, -(-4 * 60 * 2**20 // per))
        qs = [torch.randn(B, Hq, D, device=dev, dtype=torch.float16, generator=g) for _ in range(n)]
        ks = [torch.randn(B, L, Hkv, D, device=dev, dtype=torch.float16, generator=g) for _ in range(n)]
        vs = [torch.randn(B, L, Hkv, D, device=dev, dtype=torch.float16, generator=g) for _ in range(n)]
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        out = torch.empty_like(qs[0])
        p = None
        if hasattr(fdlib, "plan"):
            P = sys.modules["fdlib.plan"]        # the module (fdlib.plan is the function)
            rule = getattr(P.invariant_decision, "__wrapped__", P.invariant_decision)
            P.invariant_decision = rule
            if method.startswith("invariant@"):      # the schedule of invariant_decision, overridden
                import dataclasses
                def forced(*a, _k=int(method.split("@")[1]), **kw):
                    d = rule(*a, **kw)
                    extra = dict(share=0) if hasattr(d, "share") else {}   # the host's per_program, not the device's
                    return dataclasses.replace(d, per_program=min(_k, d.splits), **extra)
                forced.__wrapped__ = rule
                P.invariant_decision = forced
            kw = (dict(batch_invariant=True) if method.startswith("invariant") else dict(method=method)
                  if method in ("auto", "persistent", "streamk") else dict(method=method, num_splits=S))
            p = fdlib.plan(B, Hq, Hkv, D, L, dtype=torch.float16, device=qs[0].device, **kw)
            call = lambda i: p.run(qs[i], ks[i], vs[i], lens, out=out)
        else:
            call = lambda i: fdlib.decode_attention(qs[i], ks[i], vs[i], lens, method=method, num_splits=S,
                                                    validate=False)
        for i in range(n):
            call(i)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for j in range(24):
                call(j % n)
        graph.replay(); torch.cuda.synchronize()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(40):
                graph.replay()
            b.record(); torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / (40 * 24))
        times.sort()
        res.append(dict(B=B, H_q=Hq, H_kv=Hkv, D=D, L=L, splits=S, method=method, us=times[2],
                        plan=str(p) if p is not None else None))
        print(res[-1], file=sys.stderr, flush=True)
print(json.dumps(res))
'''


PROVENANCE = r'''
import datetime, json, torch, triton
print(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))))
'''


def options(argv):
    """(out, [(label, tree)], methods, shapes) from the command line."""
    methods, shapes, rest = ["unified", "split"], SHAPES, []
    it = iter(argv)
    for a in it:
        if a == "--methods":
            methods = next(it).split(",")
        elif a == "--shapes":
            shapes = [tuple(int(x) for x in s.split(":")) for s in next(it).split(",")]
            if any(len(s) != 6 for s in shapes):
                sys.exit("--shapes: expected B:H_q:H_kv:D:L:splits items, comma separated")
        else:
            rest.append(a)
    if len(rest) < 2 or any("=" not in a for a in rest[1:]):
        sys.exit(__doc__)
    return rest[0], [a.split("=", 1) for a in rest[1:]], methods, shapes


def main():
    out, trees, methods, shapes = options(sys.argv[1:])
    results = {}
    prov = subprocess.run([sys.executable, "-c", PROVENANCE], capture_output=True, text=True)
    results["provenance"] = dict(json.loads(prov.stdout) if prov.returncode == 0 else {"error": prov.stderr[-500:]},
                                 command=" ".join(sys.argv), trees=dict(trees),
                                 git_commit=os.environ.get("FDLIB_GIT_COMMIT"))
    for label, tree in trees:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(shapes), json.dumps(methods)], env=env,
                           capture_output=True, text=True, cwd=tree)
        sys.stderr.write(p.stderr[-3000:])
        results[label] = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else p.stderr[-2000:]
        with open(out, "w") as f:          # after every tree, so a run cut short keeps the trees it finished
            json.dump(results, f, indent=1)
    labels = [lab for lab, _ in trees]
    print("| B | H | D | L | splits | method | " + " | ".join(labels) + " |")
    print("|---" * (6 + len(labels)) + "|")
    rows = {}
    for lab in labels:
        if isinstance(results[lab], list):
            for r in results[lab]:
                key = (r["B"], r["H_q"], r["H_kv"], r["D"], r["L"], r["splits"], r["method"])
                rows.setdefault(key, {})[lab] = r["us"]
    for (B, hq, hkv, D, L, S, m), v in rows.items():
        print(f"| {B} | {hq}:{hkv} | {D} | {L} | {S} | {m} | "
              + " | ".join(f"{v[lab]:.2f}" if lab in v else "-" for lab in labels) + " |")


if __name__ == "__main__":
    main()
