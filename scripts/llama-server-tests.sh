#!/usr/bin/env bash
# llama.cpp's own server unit tests (tools/server/tests of its source tree) against a server binary, on a local model.
#
#   scripts/llama-server-tests.sh SERVER [PYTEST_ARGS...]
#
# SERVER: a llama-server binary, or `specee` for specee-server (a wrapper script that LLAMA_SERVER_BIN_PATH names,
# running `python -m specee.server` with the flags the suite passes). PYTEST_ARGS replace the default selection
# (`-m "not slow" unit`), e.g. `unit/test_tokenize.py`.
# Environment: LLAMA_SERVER_TESTS (the suite; default ../up/llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/tests
# beside the repository), SPECEE_MODEL (the model every preset uses; default SmolLM2 Q4_1, specee.paths),
# WORK_DIR (where the suite is copied and patched; default build/llama-server-tests/<name of SERVER>), PYTHON.
#
# The suite is copied and the copy patched (the suite itself is never changed nor committed): every preset loads the
# local model instead of a download (a download of anything else skips its test), and tests that start a server
# with the web UI's /tools or MCP (--tools, --mcp-servers-*, --ui-mcp-proxy: shell commands and fetches on the host)
# are not applicable: test_tools_builtin.py, test_mcp_servers.py and test_proxy.py are left out, any other such
# start skips. Prints pass/fail/skip counts and the failures grouped by cause; exits 0 whatever the suite's result
# (1 when it could not run).
set -euo pipefail

if [ $# -lt 1 ]; then
    sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
    exit 1
fi
REPO=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
SERVER=$1
shift
SUITE=${LLAMA_SERVER_TESTS:-$REPO/../up/llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/tests}
if [ ! -f "$SUITE/utils.py" ] || [ ! -d "$SUITE/unit" ]; then
    echo "llama-server-tests: no llama.cpp server test suite at $SUITE (set LLAMA_SERVER_TESTS)" >&2
    exit 1
fi
MODEL=${SPECEE_MODEL:-$("$PYTHON" -c 'import specee.paths as p; print(p.default_model_path())')}
if [ ! -f "$MODEL" ]; then
    echo "llama-server-tests: no model file $MODEL (set SPECEE_MODEL)" >&2
    exit 1
fi
NAME=$(basename -- "$SERVER")
WORK=${WORK_DIR:-$REPO/build/llama-server-tests/$NAME}
rm -rf "$WORK"
mkdir -p "$WORK"
# the suite's own layout (tools/server/tests), so its relative paths to llama.cpp's chat templates
# (../../../models/templates) resolve: models/ is a link to the source tree's
TESTS=$WORK/tools/server/tests
mkdir -p "$WORK/tools/server"
cp -r "$SUITE" "$TESTS"
if [ -d "$SUITE/../../../models" ]; then
    ln -s "$(cd -- "$SUITE/../../../models" && pwd)" "$WORK/models"
fi
mkdir -p "$TESTS/tmp"

if [ "$SERVER" = specee ]; then
    BIN=$WORK/specee-server
    printf '#!/bin/sh\nexec %q -m specee.server "$@"\n' "$(command -v "$PYTHON")" > "$BIN"
    chmod +x "$BIN"
else
    BIN=$(cd -- "$(dirname -- "$SERVER")" && pwd)/$(basename -- "$SERVER")
    if [ ! -x "$BIN" ]; then
        echo "llama-server-tests: $SERVER is not an executable" >&2
        exit 1
    fi
fi

# ---- the patch: local model, no downloads, /tools and MCP not applicable
"$PYTHON" - "$TESTS/utils.py" <<'EOF'
import sys

path = sys.argv[1]
text = open(path).read()
text = text.replace("\nimport wget\n", "\n")  # downloads are skipped (below); the package is not needed
text += '''

# ---- patched by specee's scripts/llama-server-tests.sh: every preset on one local model, no downloads
LOCAL_MODEL = os.environ["LLAMA_SERVER_TESTS_MODEL"]
NOT_APPLICABLE = ("server_tools", "server_tools_runtime", "mcp_servers_config", "mcp_servers_json", "ui_mcp_proxy")
_suite_start = ServerProcess.start


def _start_on_local_model(self, *args, **kwargs):
    import pytest
    on = [name for name in NOT_APPLICABLE if getattr(self, name)]
    if on:
        pytest.skip("not applicable: the web UI's /tools and MCP run commands and fetches on the host (" +
                    ", ".join(on) + ")")
    if self.model_hf_repo or self.model_hf_file or self.model_url:
        self.model_hf_repo = self.model_hf_file = self.model_url = None
        self.model_file = LOCAL_MODEL
    return _suite_start(self, *args, **kwargs)


def _no_download(url, output_file_path=None):
    import pytest
    if url.endswith("stories15M-q4_0.gguf"):  # the speculative tests' draft model: the local model drafts itself
        return LOCAL_MODEL
    pytest.skip("needs a download: " + url)


ServerProcess.start = _start_on_local_model
download_file = _no_download
ServerPreset.load_all = staticmethod(lambda: None)
'''
open(path, "w").write(text)
EOF

cd "$TESTS"
if [ $# -eq 0 ]; then
    set -- -m "not slow" unit
fi
echo "llama-server-tests: $BIN on $MODEL, in $TESTS" >&2
LLAMA_SERVER_BIN_PATH=$BIN LLAMA_SERVER_TESTS_MODEL=$MODEL "$PYTHON" -m pytest -p no:cacheprovider -q \
    --ignore=unit/test_tools_builtin.py --ignore=unit/test_mcp_servers.py --ignore=unit/test_proxy.py \
    -o junit_logging=all --junitxml="$WORK/results.xml" "$@" > "$WORK/pytest.log" 2>&1 || true
if [ ! -s "$WORK/results.xml" ]; then
    tail -20 "$WORK/pytest.log" >&2
    exit 1
fi

# ---- the report: counts, then the failures grouped by cause
"$PYTHON" - "$WORK/results.xml" "$NAME" <<'EOF'
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict

path, name = sys.argv[1:3]
counts = dict(passed=0, failed=0, skipped=0)
causes: dict[str, list[str]] = defaultdict(list)
skips: dict[str, int] = defaultdict(int)


def cause_of(case: ET.Element, bad: ET.Element) -> str:
    """A failure's cause in one line: for a server that did not start, its own error line; else the failing line of
    the test and its message's first line (addresses, ids and timestamps blurred, so that tests failing alike group
    together)."""
    message = (bad.get("message") or bad.text or "").strip()
    out = "\n".join(x.text or "" for tag in ("system-out", "system-err") for x in case.iter(tag))
    if "Server process died" in message or "did not start" in message:
        errors = [line.strip() for line in out.splitlines()
                  if re.search(r"error|unrecognized|refused|invalid|not supported", line, re.I)
                  and not line.startswith(("tests:", "Response from", "server pid"))]
        return "start: " + (errors[-1][:160] if errors else message.splitlines()[0][:160])
    first = message.splitlines()[0] if message else "(no message)"
    where = [line[1:].strip() for line in (bad.text or "").splitlines() if line.startswith(">")]
    if where and not first.startswith(where[-1]):
        first = f"{where[-1][:80]}  ->  {first}"
    first = re.sub(r"0x[0-9a-f]+|\b[a-z]+-[0-9a-f]{16,}\b|\b\d{9,}\b", "#", first)
    return first[:200]


for case in ET.parse(path).getroot().iter("testcase"):
    test = case.get("classname", "").split(".")[-1] + "::" + case.get("name", "")
    bad = case.find("failure")
    bad = case.find("error") if bad is None else bad
    skipped = case.find("skipped")
    if bad is not None:
        counts["failed"] += 1
        causes[cause_of(case, bad)].append(test)
    elif skipped is not None:
        counts["skipped"] += 1
        skips[(skipped.get("message") or "").split(" (")[0][:100]] += 1
    else:
        counts["passed"] += 1
total = sum(counts.values())
print(f"llama.cpp server tests on {name}: {counts['passed']} passed, {counts['failed']} failed, "
      f"{counts['skipped']} skipped, of {total}")
for why, n in sorted(skips.items(), key=lambda kv: -kv[1]):
    print(f"  skipped {n:4d}  {why}")
if causes:
    print("failures by cause (tests, cause, first tests):")
for why, tests in sorted(causes.items(), key=lambda kv: -len(kv[1])):
    shown = ", ".join(tests[:3]) + (f", ... (+{len(tests) - 3})" if len(tests) > 3 else "")
    print(f"  {len(tests):4d}  {why}\n        {shown}")
EOF
