#!/usr/bin/env python3
"""dev/gsq-kinds.py FILE.gguf: per tensor kind, the layout(s) and the mean importance-weighted error (RTN -> stored)."""
import sys, re, collections
from ninfer.gsq_file import tensor_infos
_, infos = tensor_infos(sys.argv[1])
by = collections.defaultdict(list)
for n, i in infos.items():
    by[re.sub(r"blk\.\d+\.", "", n)].append(i)
for k, v in sorted(by.items()):
    g = [i for i in v if i["type"] == "GSQ-RCO"]
    kept = collections.Counter(i["type"] for i in v if i["type"] != "GSQ-RCO")
    lay = collections.Counter(f"{i['bits']}/{i['slots']}" for i in g)
    if not g and not any(len(i["shape"]) == 2 for i in v):
        continue
    e = f"{sum(i['err'] for i in g) / len(g):.2e}" if g else "-"
    r = f"{sum(i['err_rtn'] for i in g) / len(g):.2e}" if g else "-"
    parts = [", ".join(f"{c}x {lay}" for lay, c in lay.items())] if g else []
    parts += ["kept: " + ", ".join(f"{c}x {t}" for t, c in kept.items())] if kept else []
    print(f"| {k.replace('.weight', '')} | {'; '.join(parts)} | {r} | {e} |")
