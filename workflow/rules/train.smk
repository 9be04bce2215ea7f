# Training: DeepSpeed data-parallel ranks started by `python -m dsflow train`.
# checkpoints/ and dvclive/ are deliberately not outputs: Snakemake deletes a job's outputs before
# it runs, and these two must survive so a rerun resumes (DVC marks them persist: true).


rule train:
    input:
        code(
            "data/shards.py",
            "model",
            "plan/comm.py",
            "plan/layouts.py",
            "plan/memory.py",
            "plan/request.py",
            "plan/tables.py",
            "train",
            "atomic.py",
            "checks.py",
            "dsconfig.py",
            "errors.py",
            "launch.py",
            "machine.py",
            "params.py",
            "paths.py",
            "progress.py",
            "safeload.py",
        ),
        "data/shards",
        "data/tokenizer",
        "data/pretrained.json",
        "reports/plan.json",
    output:
        directory("models/final"),
        "metrics/train.json",
    params:
        **P("seed", "model", "train"),
    resources:
        gpus=train_gpus(),
        **cluster_resources(nodes=config["train"]["nodes"]),
    threads: os.cpu_count() or 1  # Snakemake caps this at --cores
    log:
        "logs/train.log",
    shell:
        "python -m dsflow train"


rule plan:
    input:
        code(
            "model/build.py",
            "model/fastpaths.py",
            "model/float8.py",
            "model/flops.py",
            "model/fp8.py",
            "model/groupgemm.py",
            "model/hfkernels.py",
            "model/lora.py",
            "model/mtp.py",
            "model/presets.py",
            "model/source.py",
            "plan",
            "atomic.py",
            "dsconfig.py",
            "errors.py",
            "machine.py",
            "params.py",
            "paths.py",
            "progress.py",
            "safeload.py",
        ),
        "data/shards",
        "data/pretrained.json",
    output:
        "reports/plan.json",
    params:
        **P("model", "train"),
    log:
        "logs/plan.log",
    shell:
        "python -m dsflow plan"
