# The checkpoint to start from (model.pretrained, resolved once), then the data stages:
# download -> tokenizer -> tokenize -> shard.


rule pretrained:
    input:
        code(
            "model/presets.py",
            "model/source.py",
            "atomic.py",
            "errors.py",
            "paths.py",
            "pretrained.py",
            "progress.py",
        ),
    output:
        "data/pretrained.json",
    params:
        **P("model.pretrained", "model.revision"),
    log:
        "logs/pretrained.log",
    shell:
        "python -m dsflow pretrained"


rule download:
    input:
        code(
            "data/download.py",
            "data/grammar.py",
            "data/grammar.txt",
            "data/hub.py",
            "data/raw.py",
            "data/textfiles.py",
            "atomic.py",
            "errors.py",
            "paths.py",
            "progress.py",
        ),
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
        code(
            "data/raw.py",
            "data/shards.py",
            "data/textfiles.py",
            "data/tokenizer.py",
            "model/build.py",
            "model/fp8.py",
            "model/mtp.py",
            "model/presets.py",
            "model/source.py",
            "atomic.py",
            "errors.py",
            "paths.py",
            "progress.py",
            "safeload.py",
        ),
        "data/raw",
        "data/pretrained.json",
    output:
        directory("data/tokenizer"),
    params:
        **P("seed", "tokenizer", "model.pretrained", "model.revision"),
    log:
        "logs/tokenizer.log",
    shell:
        "python -m dsflow tokenizer"


rule tokenize:
    input:
        code(
            "data/raw.py",
            "data/textfiles.py",
            "data/tokenizing.py",
            "atomic.py",
            "errors.py",
            "paths.py",
            "progress.py",
        ),
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
        code("data/shard.py", "atomic.py", "errors.py", "paths.py", "progress.py"),
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
