#!/usr/bin/env python3
"""The quality table (markdown) from a directory of `sparda perplexity --json` reports, as
scripts/device/quality.sh writes them (one folder per text, one JSON per mode):

    python3 scripts/quality_table.py DIR > DIR.md

Per text, one row per mode: perplexity with its 95 % interval, and against the base run named in
the report (--kl-base): Δ perplexity with its interval, KL(base ‖ this) mean / median / p99 over
the base's top-K plus the rest (a lower bound of the full KL), top-1 agreement. Standard library
only."""
import json
import pathlib
import sys

ORDER = [
    ("dense", "dense (base)"),
    ("infllmv2_b48_s16", "InfLLM-V2, budget 48, select 16"),
    ("infllmv2_b64_s16", "InfLLM-V2, budget 64, select 16"),
    ("infllmv2_b96_s24", "InfLLM-V2, budget 96, select 24"),
    ("infllmv2_b64_s16_dense_prefill", "InfLLM-V2 64/16, dense prefill"),
    ("infllmv2_b64_s16_offload", "InfLLM-V2 64/16, offloaded KV"),
    ("infllmv2_b64_s16_offload_vs_resident", "InfLLM-V2 64/16, offloaded vs resident"),
    ("forecast_random_b64_s16", "forecast (random weights) 64/16"),
    ("forecast_random_b64_s16_offload_prefetch_vs_resident",
     "forecast 64/16, offloaded + prefetch vs resident"),
    ("cpu_dense", "CPU reference, dense (base)"),
    ("gpu_dense_vs_cpu", "GPU dense vs CPU dense"),
    ("cpu_infllmv2_b64_s16", "CPU reference, InfLLM-V2 64/16 (base)"),
    ("gpu_infllmv2_b64_s16_vs_cpu", "GPU InfLLM-V2 64/16 vs CPU"),
]


def fmt_ci(v, ci, digits=2, sign=False):
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    s = f.format(v)
    if ci:
        s += f" [{f.format(ci[0])}, {f.format(ci[1])}]"
    return s


def base_name(kl):
    b = pathlib.Path(kl["base"]).stem
    return {"dense": "dense", "b64": "InfLLM-V2 64/16 resident", "fc": "forecast resident",
            "cpu_dense": "CPU dense", "cpu_b64": "CPU InfLLM-V2 64/16"}.get(b, b)


def table(folder):
    rows = []
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    names = [n for n, _ in ORDER if n in runs] + sorted(set(runs) - {n for n, _ in ORDER})
    labels = dict(ORDER)
    first = runs[names[0]]
    ch = first["chunking"]
    rows.append(f"### {folder.name}: {ch['chunks']} chunks × {ch['context']} tokens, "
                f"the last {ch['score']} of each scored ({first['tokens_scored']} positions)\n")
    rows.append("| mode | backend | perplexity [95 %] | vs | Δ perplexity [95 %] | KL mean | "
                "KL median | KL p99 | top-1 agree | scoring tokens/s |")
    rows.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in names:
        r = runs[n]
        kl = r.get("kl")
        backend = "GPU" if r["mode"]["backend"].startswith("cuda") else "CPU"
        if r["mode"]["kv"].startswith("offload"):
            backend += ", offloaded"
        cells = [labels.get(n, n), backend, fmt_ci(r["ppl"], r.get("ppl_ci95"))]
        if kl:
            cells += [base_name(kl), fmt_ci(kl["delta_ppl"], kl.get("delta_ppl_ci95"), 3, True),
                      f"{kl['kl_mean']:.2e}", f"{kl['kl_median']:.2e}", f"{kl['kl_p99']:.2e}",
                      f"{kl['top1_agreement_pct']:.2f} %"]
        else:
            cells += ["–"] * 6
        cells.append(f"{r['timing']['score_tokens_per_s']:.0f}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def main():
    d = pathlib.Path(sys.argv[1])
    folders = [f for f in sorted(d.iterdir()) if f.is_dir() and any(f.glob("*.json"))]
    any_run = json.loads(next(folders[0].glob("*.json")).read_text())
    print(f"# Quality of each mode: SmolLM2-135M-Instruct fixture, 8K context\n")
    print(f"GPU {any_run.get('gpu') or '–'}, commit {any_run['commit']}, "
          f"{any_run['date_utc'][:10]}; `sparda perplexity` reports in {d}/ "
          f"(commands: scripts/device/quality.sh, phase `table`). KL is KL(base ‖ this) over the "
          f"base's top-64 ids plus one bucket for the rest: a lower bound of the full KL.\n")
    for f in folders:
        print(table(f))


if __name__ == "__main__":
    main()
