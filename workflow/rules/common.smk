# Load and validate the config once. dsflow's own validator gives a one-line message naming the
# key; Snakemake's validate() then checks the same schema and fills its defaults.
import json
import os
import sys
from pathlib import Path

from snakemake.utils import validate

from dsflow import machine
from dsflow import params as params_mod
from dsflow.errors import UsageError



def config_source():
    """The files Snakemake's config came from, as a message names them: the Snakefile's
    configfile, then --configfile overlays, then --config."""
    given = [Path(f).absolute() for f in workflow.overwrite_configfiles]
    files = [str(f) for f in workflow.configfiles if Path(f).absolute() not in given]
    files += [os.path.relpath(f) for f in given]
    if workflow.config_settings.config:
        files.append("--config")
    return " + ".join(files) or "Snakemake config"


os.environ[params_mod.CONFIG_SOURCE_ENV] = config_source()
try:
    config.update(
        params_mod.validate(dict(config), source=os.environ[params_mod.CONFIG_SOURCE_ENV])
    )
except UsageError as e:
    sys.exit(f"dsflow: error: {e}")
validate(config, schema="../schemas/params.schema.yaml")

# Stages read params from here when Snakemake runs them, so --configfile overlays and --config
# overrides reach the command exactly as Snakemake validated them.
os.environ[params_mod.CONFIG_ENV] = json.dumps(config, sort_keys=True)


def P(*keys):
    """Rule params for dotted params.yaml keys, named as dvc.yaml names them ('.' -> '__').
    Snakemake reruns a job whose params changed and prints them in its reason line, so a whole
    section (the train stage's is most of params.yaml) goes in as a short digest."""
    out = {}
    for key in keys:
        value = params_mod.get(config, key)
        if isinstance(value, (dict, list)):
            value = params_mod.digest(value)
        out[key.replace(".", "__")] = value
    return out


def code(*paths):
    """The dsflow code a stage runs (files and folders under workflow/dsflow), as files: editing
    one reruns the stage here as in DVC, which hashes the folders dvc.yaml names."""
    files = []
    for path in paths:
        path = os.path.join("workflow", "dsflow", path)
        if os.path.isdir(path):
            files += sorted(str(p) for p in Path(path).rglob("*.py") if p.stat().st_size)
        else:
            files.append(path)
    return files


def train_gpus():
    """GPUs the train rule occupies (0 on CPU), for Snakemake's scheduler and cluster jobs."""
    train = config["train"]
    # device auto asks for train.gpus even where Snakemake reads the workflow without GPUs: a
    # cluster's submit host has none, its train nodes do (the executor is not known yet here).
    if train["device"] == "cpu":
        return 0
    if train["gpus"] != "auto":
        return train["gpus"]
    return machine.scheduler_gpus()


def cluster_resources(nodes=1):
    """What a cluster job (Snakemake's SLURM executor, see profiles/slurm/) asks for: `nodes`
    nodes, each with train.gpus GPUs and one task. Training asks for train.nodes nodes (its
    stage runs once per node and starts that node's ranks itself), evaluation for one."""
    gpus = train_gpus()
    if gpus:
        # --gres is per node; with GPUs and no task count, sbatch runs one task per node.
        return {"nodes": nodes, "gres": f"gpu:{gpus}"}
    return {"nodes": nodes, "tasks": nodes}
