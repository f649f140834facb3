"""The distributions whose descriptions (README) enter the recovery mixture's prose.

Fixed as a list (the 167 with a real description installed by scripts/setup.sh on 2026-12-04,
Python 3.11) rather than read from whatever is installed, so that installing a tool (a linter, a
test library) does not change the mixture under a campaign of recovery runs. One that is not
installed is skipped; the fingerprint (names and sizes) records what a machine had."""

RECOVERY_DISTRIBUTIONS = frozenset({
    "absl-py", "accelerate", "aiohappyeyeballs", "aiohttp", "aiosignal", "annotated-doc",
    "annotated-types", "anyio", "asttokens", "attrs", "bfi", "cellpylib", "certifi", "chardet",
    "charset-normalizer", "click", "cloudpickle", "colorama", "comm", "contourpy", "cwevals",
    "cycler", "dataproperty", "datasets", "defusedxml", "dill", "distro", "drawsvg", "evaluate",
    "executing", "fastapi", "fastjsonschema", "filelock", "fonttools", "frozenlist", "fsspec",
    "gguf", "googleapis-common-protos", "h11", "hf-xet", "httpcore", "httpcore2", "httpx",
    "httpx2", "huggingface-hub", "hydra-core", "hydra-submitit-launcher", "idna", "iniconfig",
    "ipykernel", "ipython", "ipython-pygments-lexers", "jedi", "jinja2", "jiter", "joblib",
    "jsonschema", "jsonschema-specifications", "jupyter-client", "kernels", "lightning",
    "lightning-utilities", "lm-eval", "lxml", "magiccube", "markdown-it-py", "markupsafe",
    "matplotlib", "matplotlib-inline", "mbstrdecoder", "mdurl", "more-itertools", "mpmath",
    "multidict", "multiprocess", "narwhals", "nbclient", "nest-asyncio2", "networkx", "nltk",
    "numpy", "omegaconf", "openai", "opentelemetry-api", "opentelemetry-exporter-http-transport",
    "opentelemetry-exporter-otlp-common", "opentelemetry-exporter-otlp-proto-common",
    "opentelemetry-exporter-otlp-proto-http", "opentelemetry-proto", "opentelemetry-sdk",
    "opentelemetry-semantic-conventions", "packaging", "pandas", "parso", "pathvalidate",
    "pexpect", "pillow", "pip", "platformdirs", "pluggy", "portalocker", "prometheus-client",
    "prompt-toolkit", "propcache", "psutil", "ptyprocess", "pure-eval", "pyarrow", "pycosat",
    "pydantic", "pydantic-core", "pyfiglet", "pygments", "pyparsing", "pytablewriter", "pytest",
    "python-dateutil", "pytorch-lightning", "pytz", "pyyaml", "pyzmq", "referencing", "regex",
    "requests", "rich", "rouge-score", "rpds-py", "sacrebleu", "safetensors", "scikit-learn",
    "scipy", "sentencepiece", "setuptools", "shellingham", "six", "sniffio", "sqlitedict",
    "stack-data", "starlette", "submitit", "sympy", "tabledata", "tabulate", "tcolorpy",
    "tenacity", "threadpoolctl", "tiktoken", "tokenizers", "tomlkit", "torch", "torchmetrics",
    "tornado", "tqdm", "traitlets", "transformers", "truststore", "typepy", "typer",
    "typing-extensions", "typing-inspection", "urllib3", "uvicorn", "wandb", "wcwidth",
    "word2number", "xxhash", "yarl",
})
