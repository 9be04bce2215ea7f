"""Stage `report`: everything about a run on one page -> reports/report.{html,md} + figures/.

The Markdown links the PNGs in reports/figures/; the HTML is that Markdown rendered by
markdown-it, self-contained (figures embedded as data URIs). A comparison section diffs params and
metrics against the previous committed run (read from git).
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
from importlib import metadata
from pathlib import Path

import numpy as np
import yaml
from markdown_it import MarkdownIt

from dsflow.atomic import atomic_dir, atomic_file
from dsflow.errors import UsageError
from dsflow.model.presets import describe, model_config
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


def new_axes(height: float):
    """A 7-inch-wide figure and its axes, drawn off-screen (no pyplot, no display)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, height))
    return fig, fig.subplots()


def step_label(tokens_per_step: float) -> str:
    """The x axis of every training figure: the optimizer step, with the tokens one step takes
    (so a loss against tokens reads off it too)."""
    return f"step ({tokens_per_step:,.0f} tokens each)"


def loss_figure(tokens_per_step: float):
    steps, loss = read_tsv("train/loss")
    if not steps:
        return None
    val_steps, val_loss = read_tsv("val/loss")
    fig, ax = new_axes(3.5)
    ax.plot(steps, loss, label="train")
    if val_steps:
        ax.plot(val_steps, val_loss, "o-", label="val (train.eval_batches)")
    ax.set(xlabel=step_label(tokens_per_step), ylabel="loss (nats/token)", title="Loss")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def lr_figure(tokens_per_step: float):
    steps, lr = read_tsv("train/lr")
    if not steps:
        return None
    fig, ax = new_axes(2.5)
    ax.plot(steps, lr)
    ax.set(xlabel=step_label(tokens_per_step), ylabel="lr", title="Learning rate")
    ax.grid(alpha=0.3)
    return fig


def throughput_figure(tokens_per_step: float):
    steps, tokens_per_s = read_tsv("perf/tokens_per_s")
    if not steps:
        return None
    fig, ax = new_axes(3)
    ax.plot(steps, tokens_per_s, label="tokens/s")
    ax.set(xlabel=step_label(tokens_per_step), ylabel="tokens/s", title="Throughput")
    mfu_steps, mfu = read_tsv("perf/mfu")
    if mfu_steps:
        mfu_ax = ax.twinx()
        mfu_ax.plot(mfu_steps, [100 * m for m in mfu], color="tab:orange", label="MFU %")
        mfu_ax.set_ylabel("MFU %")
    ax.grid(alpha=0.3)
    return fig


def memory_figure(train: dict):
    memory = train.get("peak_memory_gb_per_rank") or []
    if not memory:
        return None
    fig, ax = new_axes(2.8)
    ax.bar([f"rank {i}" for i in range(len(memory))], memory, label="measured")
    predicted = predicted_memory_gb(train)
    if predicted:
        ax.axhline(predicted, color="tab:red", ls="--", label=f"planned {predicted:.2f} GB")
        ax.legend()
    what = "allocated" if train.get("device") == "cuda" else "host RSS"
    ax.set(ylabel="GB", title=f"Peak memory per rank ({what})")
    return fig


def expert_load_figure(eval_details: Path):
    load = read_json(eval_details / "expert_load.json")
    if not load:
        return None
    layers = sorted(load, key=int)
    grid = np.array([load[k]["load"] for k in layers], dtype=float)
    grid = grid / grid.mean(axis=1, keepdims=True)
    fig, ax = new_axes(0.5 + 0.45 * len(layers))
    image = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set(xlabel="expert", ylabel="MoE layer", title="Expert load on val (1 = even)")
    ax.set_yticks(range(len(layers)), layers)
    fig.colorbar(image, ax=ax)
    return fig


def figures(train: dict, eval_details: Path) -> dict:
    """The plots there is data for, as {name: matplotlib Figure}, in report order."""
    tokens_per_step = train["tokens"] / train["step"] if train.get("step") else 1
    drawn = {
        "loss": loss_figure(tokens_per_step),
        "lr": lr_figure(tokens_per_step),
        "throughput": throughput_figure(tokens_per_step),
        "memory": memory_figure(train),
        "expert_load": expert_load_figure(eval_details),
    }
    return {name: fig for name, fig in drawn.items() if fig is not None}


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


# The stages in the order the DAG runs them; logs of anything else (another node's train log,
# export) follow, by name.
DAG_ORDER = (
    "pretrained",
    "download",
    "tokenizer",
    "tokenize",
    "shard",
    "plan",
    "doctor",
    "train",
    "evaluate",
    "report",
)


def _dag_position(name: str) -> tuple[int, str]:
    stage = name.split("-")[0]  # train-node1 -> train
    return (DAG_ORDER.index(stage) if stage in DAG_ORDER else len(DAG_ORDER), name)


def stage_times() -> list[list]:
    """[stage, seconds] of each log in logs/ that holds a finished stage, in DAG order."""
    rows = []
    for path in sorted(LOGS.glob("*.log"), key=lambda p: _dag_position(p.stem)):
        found = re.findall(r"wall_s=([0-9.]+)", path.read_text(errors="replace"))
        if found:
            rows.append([path.stem, f"{float(found[-1]):.1f}"])
    return rows


def provenance_section(prov: dict) -> list[str]:
    dirty = " (dirty working tree)" if prov["dirty"] else ""
    return [
        "## Provenance",
        "",
        f"- git commit: `{prov['commit']}`{dirty}",
        "",
        md_table([[k, v] for k, v in prov["hardware"].items()], ["hardware", "value"]),
        "",
        md_table([[k, v] for k, v in prov["versions"].items()], ["package", "version"]),
        "",
    ]


def model_section(params: dict, train: dict) -> list[str]:
    model = params["model"]
    vocab = read_json(shard_index("train")).get("vocab_size", 0)
    line = model["preset"]
    if vocab:
        line = describe(model_config(model["preset"], vocab, model["overrides"]))
    return [
        "## Model",
        "",
        f"- {line}",
        f"- total parameters: {train.get('params_total', 0):,}; activated per token: "
        f"{train.get('params_activated', 0):,}",
        "",
    ]


def data_section() -> list[str]:
    manifest = read_json(MANIFEST)
    rows = [["source", manifest.get("source")]]
    for split in ("train", "val"):
        docs = manifest.get("splits", {}).get(split, {})
        tokens = read_json(shard_index(split)).get("tokens", "-")
        rows.append(
            [
                f"{split}: documents / bytes / tokens",
                f"{docs.get('docs', '-')} / {docs.get('bytes', '-')} / {tokens}",
            ]
        )
    # The entropy floor appears once, in the evaluation: the val split's, next to what it bounds.
    return ["## Data", "", md_table(rows, ["", "value"]), ""]


TRAINING_KEYS = (
    "step",
    "tokens",
    "train_loss",
    "val_loss",
    "tokens_per_s",
    "mfu",
    "mfu_peak",  # what the MFU is against: the datasheet dense peak or train.peak_tflops
    "step_s",
    "data_wait_frac",
    "peak_memory_gb_per_rank",
    "experts_max_over_mean",
    "wall_s",
)


def training_val_windows(params: dict | None, train: dict) -> str:
    """What the training's val_loss is over, in words: the last validation's windows."""
    cfg = (params or {}).get("train", {})
    batches, micro, world = cfg.get("eval_batches"), cfg.get("micro_batch"), train.get("world_size")
    what = "the first train.eval_batches micro-batches per rank of data/shards/val"
    if all(isinstance(n, int) for n in (batches, micro, world)):
        what = (
            f"the first {batches * micro * world} windows of {cfg.get('seq_len')} tokens of "
            f"data/shards/val (train.eval_batches {batches} x micro batch {micro} x {world} "
            "rank(s))"
        )
    return f"val_loss is the run's last validation, by the model in training, over {what}."


def eval_val_windows(params: dict | None, evalm: dict) -> str:
    """What the evaluation's val_loss is over, in words, and why it differs from training's."""
    limit = (params or {}).get("evaluate", {}).get("max_windows")
    where = "every window of data/shards/val"
    if limit is not None:
        where = f"the first {limit} windows of data/shards/val (evaluate.max_windows)"
    tokens = f", {evalm['tokens']:,} tokens" if isinstance(evalm.get("tokens"), int) else ""
    return (
        f"val_loss is the exported model's (models/final) over {where}{tokens}: more of the val "
        "split than training's val_loss, which covers its first train.eval_batches batches, so "
        "the two differ."
    )


def training_section(train: dict, figure_names: list[str], params: dict | None = None) -> list[str]:
    parts = ["## Training", ""]
    # Unmeasured values (MFU on CPU, where no peak FLOP/s is known) are left out, not "None".
    rows = [[k, fmt(train[k])] for k in TRAINING_KEYS if train.get(k) is not None]
    parts += [md_table(rows, ["metric", "value"]), ""]
    if train.get("val_loss") is not None:
        parts += [training_val_windows(params, train), ""]
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
    return parts


# Said in the floor's sentence instead of the table, so the floor appears once.
FLOOR_KEYS = ("entropy_floor_bpb", "gap_bpb", "ratio_to_floor")


def evaluation_section(evalm: dict, params: dict | None = None) -> list[str]:
    rows = [
        [k, fmt(v)]
        for k, v in sorted(evalm.items())
        if k != "lm_eval" and k not in FLOOR_KEYS and v is not None
    ]
    parts = ["## Evaluation", "", md_table(rows, ["metric", "value"]), ""]
    if evalm.get("val_loss") is not None:
        parts += [eval_val_windows(params, evalm), ""]
    if evalm.get("speculative_tokens_per_step") is not None:
        parts += [mtp_sentence(evalm), ""]
    if "gap_bpb" in evalm:
        parts += [
            f"The model is {evalm['gap_bpb']:.4f} bits/byte above the entropy floor of "
            f"{evalm['entropy_floor_bpb']:.4f} bits/byte ({evalm['ratio_to_floor']:.2f}x the "
            "floor): the true entropy of the val split, known exactly from the builtin corpus's "
            "grammar.",
            "",
        ]
    return parts


def mtp_sentence(evalm: dict) -> str:
    """What the multi-token prediction depths give at inference, in words."""
    depths = sorted(int(k.rsplit("_", 1)[1]) for k in evalm if k.startswith("mtp_top1_accuracy_"))
    accuracy = ", ".join(f"{100 * evalm[f'mtp_top1_accuracy_{k}']:.1f}%" for k in depths)
    accepted = ", ".join(
        "n/a"
        if evalm.get(f"speculative_acceptance_{k}") is None
        else f"{100 * evalm[f'speculative_acceptance_{k}']:.1f}%"
        for k in depths
    )
    return (
        f"Multi-token prediction: the main head's top-1 accuracy is "
        f"{100 * evalm['top1_accuracy']:.1f}%, depth 1..{len(depths)}'s (token t+1+k) "
        f"{accuracy}. Greedy self-speculative decoding, the depths drafting and the main model "
        f"verifying, accepts {accepted} of the drafts at each depth and emits "
        f"{evalm['speculative_tokens_per_step']:.2f} tokens per step: "
        f"{evalm['speculative_speedup']:.2f}x plain decoding where a step costs the weights it "
        "reads (memory-bound decoding)."
    )


def longest_backticks(text: str) -> int:
    return max((len(run) for run in re.findall(r"`+", text)), default=0)


def fenced(text: str) -> str:
    """`text` as a Markdown code block: shown as written (line breaks, `*`, `#`), never as
    markup; the fence is longer than any run of backticks inside."""
    fence = "`" * max(3, 1 + longest_backticks(text))
    return f"{fence}text\n{text}\n{fence}"


def inline_code(text: str) -> str:
    """One line of `text` as Markdown inline code, whatever backticks it holds."""
    ticks = "`" * (1 + longest_backticks(text))
    return (
        f"{ticks} {text} {ticks}"
        if text.startswith("`") or text.endswith("`")
        else (f"{ticks}{text}{ticks}")
    )


def samples_section(eval_details: Path) -> list[str]:
    parts = ["## Samples", ""]
    for s in read_json_list(eval_details / "samples.json"):
        parts += [f"**Prompt:** {inline_code(s['prompt'])}", ""]
        for mode in ("greedy", "sampled"):
            parts += [f"{mode}:", "", fenced(s[mode]) if s[mode] else "(no text)", ""]
    return parts


def stage_times_section() -> list[str]:
    times = stage_times()
    if not times:
        return []
    return ["## Wall time per stage", "", md_table(times, ["stage", "seconds"]), ""]


def metric_changes(old_metrics: dict, train: dict, evalm: dict) -> tuple[list[list], int]:
    """([metric, before, now, change] for every number in metrics/{train,eval}.json that
    changed, how many numbers did not)."""
    rows, same = [], 0
    for f, now in ((str(TRAIN_METRICS), train), (str(EVAL_METRICS), evalm)):
        before = old_metrics.get(f, {})
        for k in sorted(set(now) | set(before)):
            a, b = before.get(k), now.get(k)
            if (
                isinstance(a, (int, float))
                and isinstance(b, (int, float))
                and not isinstance(a, bool)
            ):
                if a == b:
                    same += 1
                else:
                    rows.append([f"{Path(f).stem}.{k}", fmt(a), fmt(b), f"{b - a:+.4g}"])
    return rows, same


def comparison_section(params: dict, train: dict, evalm: dict, comparison) -> list[str]:
    parts = ["## Comparison with the previous committed run", ""]
    if comparison is None:
        return parts + ["No earlier committed run with different metrics.", ""]
    commit, old_metrics, old_params = comparison
    new_flat, old_flat = flatten(params), flatten(old_params)
    changed = [
        [k, fmt(old_flat.get(k)), fmt(new_flat.get(k))]
        for k in sorted(set(new_flat) | set(old_flat))
        if new_flat.get(k) != old_flat.get(k)
    ]
    rows, same = metric_changes(old_metrics, train, evalm)
    return parts + [
        f"Against commit `{commit[:12]}`.",
        "",
        "Params changed:",
        "",
        md_table(changed, ["param", "before", "now"]) if changed else "none",
        "",
        f"Metrics changed ({len(rows)}; {same} unchanged, not listed):",
        "",
        md_table(rows, ["metric", "before", "now", "change"]) if rows else "none",
        "",
    ]


def params_section(params: dict) -> list[str]:
    return ["## Params", "", "```yaml", yaml.safe_dump(params, sort_keys=False).rstrip(), "```", ""]


def build_markdown(params, train, evalm, details, prov, comparison, figure_names) -> str:
    parts = [
        "# dsflow run report",
        "",
        *provenance_section(prov),
        *model_section(params, train),
        *data_section(),
        *training_section(train, figure_names, params),
        *evaluation_section(evalm, params),
        *samples_section(details),
        *stage_times_section(),
        *comparison_section(params, train, evalm, comparison),
        *params_section(params),
    ]
    return "\n".join(parts)


def read_json_list(path: Path) -> list:
    return json.loads(path.read_text()) if path.exists() else []


# Raw HTML off: sample text and params are shown as text, never run as markup.
MARKDOWN = MarkdownIt("commonmark", {"html": False}).enable("table")
STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;"
    "color:#222}table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;"
    "padding:3px 8px;text-align:left}th{background:#f3f3f3}img{max-width:100%;display:block;"
    "margin:1em 0}pre{background:#f6f6f6;padding:1em;white-space:pre-wrap;overflow-wrap:anywhere}h2{border-bottom:1px solid "
    "#ddd;padding-bottom:.2em}"
)
# Marks the page with how many images failed to load, for the browser test.
BROKEN_IMAGES_CHECK = (
    "<script>window.addEventListener('load',function(){var b=0;document.querySelectorAll('img')"
    ".forEach(function(i){if(!i.complete||i.naturalWidth===0)b++});"
    "document.body.setAttribute('data-broken-images',b)});</script>"
)


def markdown_to_html(md: str, images: dict[str, bytes]) -> str:
    """The report page: `md` rendered by markdown-it, each figures/NAME.png inlined as a data
    URI from `images`, so the one file holds everything."""
    tokens = MARKDOWN.parse(md)
    for token in tokens:
        for child in token.children or []:
            src = str(child.attrGet("src") or "")
            if child.type == "image" and src.startswith("figures/") and src.endswith(".png"):
                data = base64.b64encode(images[src[len("figures/") : -len(".png")]]).decode()
                child.attrSet("src", f"data:image/png;base64,{data}")
    body = MARKDOWN.renderer.render(tokens, MARKDOWN.options, {})
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>dsflow report</title>"
        f"<style>{STYLE}</style>{BROKEN_IMAGES_CHECK}</head><body>\n{body}</body></html>\n"
    )


# `dvc plots show/diff` pages load vega, vega-lite and vega-embed from a CDN ({scripts} in
# dvc-render's page): blank offline. This page inlines the copies Snakemake installs (vega 5.21,
# vega-lite 5.2, vega-embed 6.20: what DVC's vega-lite 5 specs need) and leaves {scripts} out.
VEGA_SCRIPTS = ("vega/vega.js", "vega-lite/vega-lite.js", "vega-embed/vega-embed.js")
PLOTS_PAGE = (
    "<!DOCTYPE html>\n<html>\n<head>\n{refresh_tag}\n<meta charset='utf-8'>\n"
    "<title>DVC Plot</title>\n%s\n<style>table{border-spacing:15px}</style>\n</head>\n"
    "<body>\n{plot_divs}\n</body>\n</html>\n"
)


def vega_scripts() -> list[str]:
    """The vega scripts' text from Snakemake's installed assets (never downloaded)."""
    from importlib import resources

    try:
        base = resources.files("snakemake.assets") / "data"
        return [(base / name).read_text(encoding="utf-8") for name in VEGA_SCRIPTS]
    except (ModuleNotFoundError, OSError) as e:
        raise UsageError(
            f"no offline copy of vega here ({e}): reinstall snakemake (pip install snakemake), "
            "whose package carries vega, vega-lite and vega-embed"
        ) from e


def write_plots_template(path: Path) -> None:
    """An HTML template for `dvc plots show/diff --html-template PATH` that works offline."""
    scripts = "\n".join(f"<script>\n{js}\n</script>" for js in vega_scripts())
    with atomic_file(path, "wb") as f:
        f.write(PLOTS_PAGE.replace("%s", scripts, 1).encode())


def run(params: dict) -> None:
    train = read_json(TRAIN_METRICS)
    evalm = read_json(EVAL_METRICS)
    if not train or not evalm:
        raise UsageError(
            "metrics/train.json or metrics/eval.json missing; run train and evaluate first"
        )
    prov = provenance(params, train)
    comparison = previous_run()
    figs = figures(train, EVAL_DETAILS)
    images: dict[str, bytes] = {}
    with atomic_dir(FIGURES) as tmp:
        for name, fig in figs.items():
            # Fixed metadata so identical data gives identical PNG bytes.
            fig.tight_layout()
            fig.savefig(tmp / f"{name}.png", dpi=110, metadata={"Software": None})
            images[name] = (tmp / f"{name}.png").read_bytes()
    md = build_markdown(params, train, evalm, EVAL_DETAILS, prov, comparison, list(figs))
    with atomic_file(REPORT_MD) as f:
        f.write(md)
    with atomic_file(REPORT_HTML) as f:
        f.write(markdown_to_html(md, images))
    log.info("report: %s (and %s)", REPORT_HTML.resolve(), REPORT_MD)


if __name__ == "__main__":  # python -m dsflow.report PATH: the offline template for dvc plots
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m dsflow.report",
        description="Write an HTML template for `dvc plots show/diff --html-template PATH` "
        "with vega, vega-lite and vega-embed inlined (from the installed Snakemake): its "
        "pages draw offline.",
    )
    parser.add_argument("path", type=Path, help="where to write it, e.g. dvc_plots/offline.html")
    try:
        write_plots_template(parser.parse_args().path)
    except UsageError as e:
        sys.exit(f"python -m dsflow.report: error: {e}")
