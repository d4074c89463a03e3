import json, sys, pathlib
names = sys.argv[1:]
for name in names:
    row = []
    for w in (1, 2, 3, 5, 6):
        out = []
        for s in (1, 2):
            f = pathlib.Path(f"/tmp/lab/{name}_s{s}-w{w}.json")
            if f.exists():
                d = json.loads(f.read_text()); out.append(f"{100*d['match']:.1f}/{d['fd']:.2f}")
        if out:
            row.append(f"w{w}: " + " | ".join(out))
    print(f"{name:10s}", "   ".join(row))
