# Evaluate the exported model, then write the report.


rule evaluate:
    input:
        code(
            "data/shards.py",
            "model/balance.py",
            "model/build.py",
            "model/fp8.py",
            "model/loss.py",
            "model/mtp.py",
            "model/presets.py",
            "model/source.py",
            "atomic.py",
            "errors.py",
            "evaluate.py",
            "launch.py",
            "machine.py",
            "params.py",
            "paths.py",
            "progress.py",
            "safeload.py",
        ),
        "models/final",
        "data/shards",
        "data/raw",
    output:
        "metrics/eval.json",
        directory("reports/eval"),
    params:
        **P(
            "seed",
            "evaluate",
            "train.seq_len",
            "train.device",
            "train.gpus",
            "train.threads_per_rank",
        ),
    resources:
        gpus=train_gpus(),
        **cluster_resources(),
    log:
        "logs/evaluate.log",
    shell:
        "python -m dsflow evaluate"


rule report:
    input:
        code(
            "model/presets.py",
            "atomic.py",
            "errors.py",
            "params.py",
            "paths.py",
            "progress.py",
            "report.py",
        ),
        "metrics/train.json",
        "metrics/eval.json",
        "reports/eval",
        "reports/plan.json",
    output:
        report("reports/report.html", category="Report", labels={"type": "html"}),
        report("reports/report.md", category="Report", labels={"type": "markdown"}),
        report(
            directory("reports/figures"),
            patterns=["{name}.png"],
            category="Plots",
            labels={"figure": "{name}"},
        ),
    log:
        "logs/report.log",
    shell:
        "python -m dsflow report"
