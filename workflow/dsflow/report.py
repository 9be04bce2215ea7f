"""Stage `report`: everything about a run on one page -> reports/report.{html,md} + figures/.

The HTML is self-contained (figures embedded as data URIs); the Markdown holds the same content
and links the PNGs in reports/figures/. A comparison section diffs params and metrics against
the previous committed run (read from git).
"""

from __future__ import annotations

import base64
import html
import json
import re
import subprocess
from importlib import metadata
from pathlib import Path

import yaml

from dsflow.atomic import atomic_dir
from dsflow.errors import UsageError
from dsflow.params import flatten
from dsflow.paths import (
    EVAL_DETAILS,
    EVAL_METRICS,
    FIGURES,
    LIVE,
    LOGS,
    MANIFEST,
    PLAN,
    REPORT_HTML,
    REPORT_MD,
    TRAIN_METRICS,
    shard_index,
)
from dsflow.progress import log

LIVE_PLOTS = LIVE / "plots" / "metrics"
METRIC_FILES = (str(TRAIN_METRICS), str(EVAL_METRICS))
PACKAGES = (
    "dsflow",
    "torch",
    "deepspeed",
    "transformers",
    "tokenizers",
    "datasets",
    "snakemake",
    "dvc",
    "dvclive",
)


def read_json(path: str | Path) -> dict:
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else {}


def read_tsv(name: str) -> tuple[list[int], list[float]]:
    path = LIVE_PLOTS / f"{name}.tsv"
    if not path.exists():
        return [], []
    rows = [r.split("\t") for r in path.read_text().splitlines()[1:] if r.strip()]
    return [int(r[0]) for r in rows], [float(r[-1]) for r in rows]


def git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def provenance(params: dict, train: dict) -> dict:
    commit = (git("rev-parse", "HEAD") or "").strip() or "not a git repository"
    dirty = bool((git("status", "--porcelain", "--untracked-files=no") or "").strip())
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    return {
        "commit": commit,
        "dirty": dirty,
        "versions": versions,
        "hardware": {
            "device": train.get("device_name", train.get("device")),
            "ranks (world size)": train.get("world_size"),
            "GPU memory (GB)": round(train["gpu_memory_gb"], 1)
            if "gpu_memory_gb" in train
            else "-",
            "ZeRO stage": zero_layout(train),
            "precision": train.get("precision"),
        },
    }


def zero_layout(metrics: dict) -> str | None:
    """ "3 + optimizer offload (cpu)" from metrics/train.json."""
    stage = metrics.get("zero_stage")
    if stage is None:
        return None
    parts = [str(stage)]
    for what in ("optimizer", "param"):
        device = metrics.get(f"offload_{what}", "none")
        if device != "none":
            parts.append(f"{what} offload ({device})")
    return " + ".join(parts)


def previous_run() -> tuple[str, dict, dict] | None:
    """(commit, metrics, params) of the newest commit whose metrics differ from the working tree."""
    current = {f: read_json(f) for f in METRIC_FILES}
    log_out = git("log", "--format=%H", "-n", "30", "--", *METRIC_FILES) or ""
    for commit in log_out.split():
        old = {}
        for f in METRIC_FILES:
            text = git("show", f"{commit}:{f}")
            old[f] = json.loads(text) if text else {}
        if old != current:
            params_text = git("show", f"{commit}:params.yaml") or "{}"
            return commit, old, yaml.safe_load(params_text) or {}
    return None


def predicted_memory_gb(train: dict) -> float | None:
    """The planner's per-GPU allocation (reports/plan.json); comparable on CUDA only."""
    if train.get("device") != "cuda":
        return None
    allocated = read_json(PLAN).get("estimate", {}).get("gpu", {}).get("allocated")
    return allocated / 1e9 if allocated else None


def figure_pngs(train: dict, eval_details: Path) -> dict[str, str]:
    """Plots as {name: path}; written into the temp figure dir by the caller."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = {}
    tokens_per_step = train["tokens"] / train["step"] if train.get("step") else 1

    def save(name, fig):
        figs[name] = fig

    s, loss = read_tsv("train/loss")
    vs, vloss = read_tsv("val/loss")
    if s:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([x * tokens_per_step for x in s], loss, label="train")
        if vs:
            ax.plot([x * tokens_per_step for x in vs], vloss, "o-", label="val")
        ax.set(xlabel="tokens", ylabel="loss (nats/token)", title="Loss")
        ax.legend()
        ax.grid(alpha=0.3)
        save("loss", fig)
    s, lr = read_tsv("train/lr")
    if s:
        fig, ax = plt.subplots(figsize=(7, 2.5))
        ax.plot(s, lr)
        ax.set(xlabel="step", ylabel="lr", title="Learning rate")
        ax.grid(alpha=0.3)
        save("lr", fig)
    s, tps = read_tsv("perf/tokens_per_s")
    if s:
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.plot(s, tps, label="tokens/s")
        ax.set(xlabel="step", ylabel="tokens/s", title="Throughput")
        ms, mfu = read_tsv("perf/mfu")
        if ms:
            ax2 = ax.twinx()
            ax2.plot(ms, [100 * m for m in mfu], color="tab:orange", label="MFU %")
            ax2.set_ylabel("MFU %")
        ax.grid(alpha=0.3)
        save("throughput", fig)
    memory = train.get("peak_memory_gb_per_rank") or []
    if memory:
        fig, ax = plt.subplots(figsize=(7, 2.8))
        ax.bar([f"rank {i}" for i in range(len(memory))], memory, label="measured")
        predicted = predicted_memory_gb(train)
        if predicted:
            ax.axhline(predicted, color="tab:red", ls="--", label=f"planned {predicted:.2f} GB")
            ax.legend()
        what = "allocated" if train.get("device") == "cuda" else "host RSS"
        ax.set(ylabel="GB", title=f"Peak memory per rank ({what})")
        save("memory", fig)
    load = read_json(eval_details / "expert_load.json")
    if load:
        import numpy as np

        layers = sorted(load, key=int)
        grid = np.array([load[k]["load"] for k in layers], dtype=float)
        grid = grid / grid.mean(axis=1, keepdims=True)
        fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(layers)))
        im = ax.imshow(grid, aspect="auto", cmap="viridis")
        ax.set(xlabel="expert", ylabel="MoE layer", title="Expert load on val (1 = even)")
        ax.set_yticks(range(len(layers)), layers)
        fig.colorbar(im, ax=ax)
        save("expert_load", fig)
    return figs


def md_table(rows: list[list], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(fmt(v) for v in value)
    return str(value)


def stage_times() -> list[list]:
    rows = []
    for path in sorted(LOGS.glob("*.log")):
        found = re.findall(r"wall_s=([0-9.]+)", path.read_text(errors="replace"))
        if found:
            rows.append([path.stem, f"{float(found[-1]):.1f}"])
    return rows


def build_markdown(params, train, evalm, details, prov, comparison, figure_names) -> str:
    from dsflow.model.presets import describe, model_config

    manifest = read_json(MANIFEST)
    index = read_json(shard_index("train"))
    parts = ["# dsflow run report", ""]
    parts += ["## Provenance", ""]
    parts.append(
        f"- git commit: `{prov['commit']}`" + (" (dirty working tree)" if prov["dirty"] else "")
    )
    parts.append("")
    parts.append(md_table([[k, v] for k, v in prov["hardware"].items()], ["hardware", "value"]))
    parts += [
        "",
        md_table([[k, v] for k, v in prov["versions"].items()], ["package", "version"]),
        "",
    ]
    vocab = index.get("vocab_size", 0)
    model_line = params["model"]["preset"]
    if vocab:
        model_line = describe(
            model_config(params["model"]["preset"], vocab, params["model"]["overrides"])
        )
    parts += [
        "## Model",
        "",
        f"- {model_line}",
        f"- total parameters: {train.get('params_total', 0):,}; activated per token: "
        f"{train.get('params_activated', 0):,}",
        "",
    ]
    parts += ["## Data", ""]
    rows = [["source", manifest.get("source")]]
    for split in ("train", "val"):
        sp = manifest.get("splits", {}).get(split, {})
        idx = read_json(shard_index(split))
        rows.append(
            [
                f"{split}: documents / bytes / tokens",
                f"{sp.get('docs', '-')} / {sp.get('bytes', '-')} / {idx.get('tokens', '-')}",
            ]
        )
    if "entropy_bits_per_byte" in manifest:
        rows.append(["entropy floor (bits/byte)", f"{manifest['entropy_bits_per_byte']:.4f}"])
    parts += [md_table(rows, ["", "value"]), ""]
    parts += ["## Training", ""]
    keys = [
        "step",
        "tokens",
        "train_loss",
        "val_loss",
        "tokens_per_s",
        "mfu",
        "step_s",
        "data_wait_frac",
        "peak_memory_gb_per_rank",
        "experts_max_over_mean",
        "wall_s",
    ]
    parts += [md_table([[k, fmt(train.get(k))] for k in keys], ["metric", "value"]), ""]
    predicted = predicted_memory_gb(train)
    if predicted:
        rows = [
            [f"rank {i}", f"{predicted:.2f}", f"{m:.2f}", f"{100 * (predicted - m) / m:+.1f}%"]
            for i, m in enumerate(train.get("peak_memory_gb_per_rank", []))
        ]
        parts += [
            "Planned vs measured peak GPU memory (allocated):",
            "",
            md_table(rows, ["rank", "planned GB", "measured GB", "error"]),
            "",
        ]
    for name in figure_names:
        parts += [f"![{name}](figures/{name}.png)", ""]
    parts += ["## Evaluation", ""]
    parts += [
        md_table(
            [[k, fmt(v)] for k, v in sorted(evalm.items()) if k != "lm_eval"], ["metric", "value"]
        ),
        "",
    ]
    if "gap_bpb" in evalm:
        parts += [
            f"The model is {evalm['gap_bpb']:.4f} bits/byte above the corpus's true entropy "
            f"({evalm['ratio_to_floor']:.2f}x the floor).",
            "",
        ]
    parts += ["## Samples", ""]
    for s in read_json_list(details / "samples.json"):
        parts += [
            f"**Prompt:** `{s['prompt']}`",
            "",
            f"- greedy: {s['greedy']!r}",
            f"- sampled: {s['sampled']!r}",
            "",
        ]
    times = stage_times()
    if times:
        parts += ["## Wall time per stage", "", md_table(times, ["stage", "seconds"]), ""]
    parts += ["## Comparison with the previous committed run", ""]
    if comparison is None:
        parts += ["No earlier committed run with different metrics.", ""]
    else:
        commit, old_metrics, old_params = comparison
        parts.append(f"Against commit `{commit[:12]}`.")
        parts.append("")
        new_flat, old_flat = flatten(params), flatten(old_params)
        changed = [
            [k, fmt(old_flat.get(k)), fmt(new_flat.get(k))]
            for k in sorted(set(new_flat) | set(old_flat))
            if new_flat.get(k) != old_flat.get(k)
        ]
        parts += [
            "Params changed:",
            "",
            md_table(changed, ["param", "before", "now"]) if changed else "none",
            "",
        ]
        rows = []
        for f, now in ((str(TRAIN_METRICS), train), (str(EVAL_METRICS), evalm)):
            before = old_metrics.get(f, {})
            for k in sorted(set(now) | set(before)):
                a, b = before.get(k), now.get(k)
                if (
                    isinstance(a, (int, float))
                    and isinstance(b, (int, float))
                    and not isinstance(a, bool)
                ):
                    delta = b - a
                    rows.append([f"{Path(f).stem}.{k}", fmt(a), fmt(b), f"{delta:+.4g}"])
        parts += [md_table(rows, ["metric", "before", "now", "change"]), ""]
    parts += [
        "## Params",
        "",
        "```yaml",
        yaml.safe_dump(params, sort_keys=False).rstrip(),
        "```",
        "",
    ]
    return "\n".join(parts)


def read_json_list(path: Path) -> list:
    return json.loads(path.read_text()) if path.exists() else []


def markdown_to_html(md: str, images: dict[str, bytes]) -> str:
    """The report's own small Markdown subset (headings, tables, lists, code, images) as HTML."""
    out, table, code = [], [], False

    def inline(text: str) -> str:
        text = html.escape(text)
        text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
        return re.sub(r"`(.+?)`", r"<code>\1</code>", text)

    def flush_table():
        if table:
            rows = [r for r in table if not re.fullmatch(r"\|(---\|)+", r)]
            cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
            out.append("<table><tr>" + "".join(f"<th>{inline(c)}</th>" for c in cells[0]) + "</tr>")
            for r in cells[1:]:
                out.append("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in r) + "</tr>")
            out.append("</table>")
            table.clear()

    for line in md.splitlines():
        if line.startswith("```"):
            flush_table()
            out.append("</pre>" if code else "<pre>")
            code = not code
            continue
        if code:
            out.append(html.escape(line))
            continue
        if line.startswith("|"):
            table.append(line)
            continue
        flush_table()
        if m := re.fullmatch(r"!\[(.+?)\]\(figures/(.+?)\.png\)", line):
            data = base64.b64encode(images[m.group(2)]).decode()
            out.append(f'<img alt="{m.group(1)}" src="data:image/png;base64,{data}">')
        elif line.startswith("## "):
            out.append(f"<h2>{inline(line[3:])}</h2>")
        elif line.startswith("# "):
            out.append(f"<h1>{inline(line[2:])}</h1>")
        elif line.startswith("- "):
            out.append(f"<li>{inline(line[2:])}</li>")
        elif line.strip():
            out.append(f"<p>{inline(line)}</p>")
    flush_table()
    style = (
        "body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;"
        "color:#222}table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;"
        "padding:3px 8px;text-align:left}th{background:#f3f3f3}img{max-width:100%;display:block;"
        "margin:1em 0}pre{background:#f6f6f6;padding:1em;overflow:auto}h2{border-bottom:1px solid "
        "#ddd;padding-bottom:.2em}"
    )
    # Marks the page with how many images failed to load, for the browser test.
    check = (
        "<script>window.addEventListener('load',function(){var b=0;document.querySelectorAll('img')"
        ".forEach(function(i){if(!i.complete||i.naturalWidth===0)b++});"
        "document.body.setAttribute('data-broken-images',b)});</script>"
    )
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>dsflow report</title>"
        f"<style>{style}</style>{check}</head><body>\n" + "\n".join(out) + "\n</body></html>\n"
    )


def run(params: dict) -> None:
    train = read_json(TRAIN_METRICS)
    evalm = read_json(EVAL_METRICS)
    if not train or not evalm:
        raise UsageError(
            "metrics/train.json or metrics/eval.json missing; run train and evaluate first"
        )
    details = EVAL_DETAILS
    prov = provenance(params, train)
    comparison = previous_run()
    figs = figure_pngs(train, details)
    images: dict[str, bytes] = {}
    with atomic_dir(FIGURES) as tmp:
        for name, fig in figs.items():
            # Fixed metadata so identical data gives identical PNG bytes.
            fig.tight_layout()
            fig.savefig(tmp / f"{name}.png", dpi=110, metadata={"Software": None})
            images[name] = (tmp / f"{name}.png").read_bytes()
    md = build_markdown(params, train, evalm, details, prov, comparison, list(figs))
    from dsflow.atomic import atomic_file

    with atomic_file(REPORT_MD) as f:
        f.write(md)
    with atomic_file(REPORT_HTML) as f:
        f.write(markdown_to_html(md, images))
    log.info("report: %s (and %s)", REPORT_HTML.resolve(), REPORT_MD)
