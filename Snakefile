# dsflow's Snakemake front-end. Every rule runs `python -m dsflow <stage>`, exactly the command the
# stage of the same name in dvc.yaml runs, with the same inputs, outputs and params
# (tests/unit/test_frontends.py fails if the two drift).
from snakemake.utils import min_version

min_version("9.0")


configfile: "params.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        rules.report.output,


onsuccess:
    if os.path.exists("reports/report.html"):
        print(f"dsflow: report at {os.path.abspath('reports/report.html')}")
