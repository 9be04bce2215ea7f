# Data stages: download -> tokenizer -> tokenize -> shard.


rule download:
    input:
        code("download", "grammar"),
    output:
        directory("data/raw"),
    params:
        **P("seed", "download"),
    log:
        "logs/download.log",
    shell:
        "python -m dsflow download"


rule tokenizer:
    input:
        code("tokenizer"),
        "data/raw",
    output:
        directory("data/tokenizer"),
    params:
        **P("tokenizer"),
    log:
        "logs/tokenizer.log",
    shell:
        "python -m dsflow tokenizer"


rule tokenize:
    input:
        code("tokenize"),
        "data/raw",
        "data/tokenizer",
    output:
        directory("data/tokens"),
    params:
        **P("tokenize"),
    log:
        "logs/tokenize.log",
    shell:
        "python -m dsflow tokenize"


rule shard:
    input:
        code("shard"),
        "data/tokens",
        "data/tokenizer",
    output:
        directory("data/shards"),
    params:
        **P("shard"),
    log:
        "logs/shard.log",
    shell:
        "python -m dsflow shard"
