#!/usr/bin/env bash
# Run a list of GPU jobs on the device machine, each under its own timeout, and pack
# everything they wrote into ONE file ($OUT/round.tgz, unpacked: round/results,
# round/logs, round/steps.txt): a device call brings back only a few files, so loose
# result files can be lost.
#
#   bash tools/gpu_round.sh JOBS_FILE [NAME...]
#
# With names, only those jobs run (in the file's order): one list split over calls.
# JOBS_FILE: one job a line, "NAME SECONDS COMMAND..." ('#' lines skipped); a command
# writes its JSON under $R (results) and its output goes to logs/NAME.log. Wheels in
# .whl/ (see the device README) are installed first when present. MINILLM_CODE_COMMIT and
# MINILLM_CODE_SHA256 are taken from the environment, or from files CODE_COMMIT and
# CODE_SHA256 next to the jobs file, so the stored results name the commit that ran
# (and benchmarks refuse code that is not it) even where the copy's .git is stale.
set -u
jobs_file=$1
shift
only=" $* "
: "${OUT:?run this on the device machine, where \$OUT is set}"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
commit_file=$(dirname "$jobs_file")/CODE_COMMIT
if [ -z "${MINILLM_CODE_COMMIT:-}" ] && [ -f "$commit_file" ]; then
    export MINILLM_CODE_COMMIT=$(cat "$commit_file")
fi
# the copy's .git may be stale: the code hash of that commit (python -m benchmarks.common
# prints both on a clean tree) lets benchmarks/common.py check the copy is that commit
sha_file=$(dirname "$jobs_file")/CODE_SHA256
if [ -z "${MINILLM_CODE_SHA256:-}" ] && [ -f "$sha_file" ]; then
    export MINILLM_CODE_SHA256=$(cat "$sha_file")
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} TOKENIZERS_PARALLELISM=false
work=$(mktemp -d)
export R=$work/round/results L=$work/round/logs
mkdir -p "$R" "$L"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$work/round/gpu.txt" 2>&1
start=$(date +%s)
pack() { tar czf "$OUT/round.tgz" -C "$work" round; }
trap pack EXIT
while read -r name seconds command; do
    case "$name" in '' | '#'*) continue ;; esac
    if [ "$only" != "  " ] && [[ "$only" != *" $name "* ]]; then continue; fi
    begin=$(date +%s)
    timeout -k 5 "$seconds" bash -c "$command" > "$L/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $(($(date +%s) - begin)) s (at $(($(date +%s) - start)) s)" \
        | tee -a "$work/round/steps.txt"
    pkill -9 -f "minillm.server|benchmarks/serve.py" 2> /dev/null
    pack  # after every job: a call cut off by its limit still brings back what is done
done < "$jobs_file"
