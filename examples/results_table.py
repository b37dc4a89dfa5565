"""Print the Markdown table of docs/results.md from the --json files the examples wrote.

python examples/results_table.py docs/results/*.json
"""

import json
import sys


def cell(s) -> str:
    return "-" if not s else f"{s['mean']:.4f} ± {s['std']:.4f}"


def main(paths) -> None:
    print(
        "| data set, model | metric | numbactr | PyTorch | published (source) | seeds | s/seed numbactr / PyTorch | command |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for path in paths:
        r = json.load(open(path))
        n = len(r["runs"]["numbactr"])
        t = r["seconds"]
        speed = (
            f"{t['numbactr'] / n:.0f} / {t['pytorch'] / n:.0f}"
            if r["runs"]["pytorch"]
            else f"{t['numbactr'] / n:.0f} / -"
        )
        for metric, s in r["summary"].items():
            pub = s.get("published")
            src = s.get("published_source", "")
            pub_text = f"{pub} ({src})" if pub is not None else src
            print(
                f"| {r['example']} | {metric} | {cell(s.get('numbactr'))} | {cell(s.get('pytorch'))} | {pub_text} | {n} | {speed} | `{r['command']}` |"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
