#!/usr/bin/env bash
# `ddtree doctor` on the GPU machine in every state that matters, verdicts and raw facts kept.
#
#   benchmarks/sglang_h200/doctor_states.sh OUT_DIR [PHASE...]
#
# Run from the repository root on the machine where `run.py install` has run (state under
# $DDTREE_H200_STATE, default /tmp/ddtree-h200). Phases, in order (default: all of them;
# each takes minutes, so they can also be run one at a time):
#
#   bare       the image alone: no SGLang on the path, no servers
#   installed  the bundle's SGLang (the release prepare.py --sglang chose) on the path, as
#              run.py's servers see it; also with --snapshot on the patched snapshot
#   serve      run.py serve plain / dflash --block 16 / ddtree --block 16 --budget 64
#   serving    the servers up: doctor with one --port per server ($DOCTOR_PORTS, default
#              30000 30001 30002, the serve phase's three; after run.py validate, whose four
#              servers use 30000-30003: DOCTOR_PORTS="30000 30001 30002 30003")
#   leftover   plain's launcher killed with SIGKILL, its sglang:: children left behind;
#              the verdict's kill applied, then doctor again
#   broken     sglang-kernel 0.4.6.post1 (bundle extra/, prepare.py --broken-kernel) shadowing
#              the kernel the release pins (0.4.3 for 0.5.13, 0.4.5 for 0.5.17), as in
#              sgl-project/sglang issue 36462
#   repaired   the kernel pin that doctor names installed over it (offline, into the same
#              folder), then doctor again
#   stop       run.py stop all; the broken-kernel folder removed
#
# For each state NAME: NAME.doctor.json (doctor --json), NAME.facts.json (--save-facts, the
# facts the verdicts were made from), NAME.stderr, and one summary line on stdout.
set -u

OUT=${1:?usage: doctor_states.sh OUT_DIR [PHASE...]}
shift
PHASES=${*:-bare installed serve serving leftover broken repaired stop}
STATE=${DDTREE_H200_STATE:-/tmp/ddtree-h200}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
RUN=(python3 "$REPO/benchmarks/sglang_h200/run.py" --state "$STATE")
BROKEN="$STATE/broken-kernel"
SERVING_PATH="$REPO:$STATE/bundle/snapshot:$STATE/bundle/site:$STATE/site"
BROKEN_PATH="$REPO:$STATE/bundle/snapshot:$BROKEN:$STATE/bundle/site:$STATE/site"
# the servers' ports (the serve phase: 30000-30002; run.py validate adds 30003 for a 2nd budget)
read -r -a PORTS <<<"$(printf -- '--port %s ' ${DOCTOR_PORTS:-30000 30001 30002})"
mkdir -p "$OUT"

summary() {  # NAME EXIT: one line with the failing and warning checks
    python3 - "$OUT/$1.doctor.json" "$1" "$2" <<'EOF'
import json, sys
path, name, code = sys.argv[1:]
try:
    report = json.load(open(path))
except (OSError, ValueError) as exc:
    print(f"{name}: exit {code}, no JSON ({exc})")
    raise SystemExit(0)
bad = [c for c in report["checks"] if c["status"] in ("fail", "warn")]
print(f"{name}: exit {code}, ok={report['ok']}, "
      + (", ".join(f"{c['status']} {c['id']}" for c in bad) or "no fail, no warn"))
for c in bad:
    print(f"  {c['status']} {c['id']}: {c['detail'][:300]}\n    fix: {c['fix'][:300]}")
EOF
}

doctor() {  # NAME PYTHONPATH [doctor options...]
    local name=$1 path=$2
    shift 2
    PYTHONPATH="$path" python3 -m ddtree_cli doctor --python python3 --json \
        --save-facts "$OUT/$name.facts.json" "$@" >"$OUT/$name.doctor.json" 2>"$OUT/$name.stderr"
    summary "$name" $?
}

check_fix() {  # NAME ID: the fix doctor gave for one check
    python3 -c 'import json, sys
report = json.load(open(sys.argv[1]))
print(next((c["fix"] for c in report["checks"] if c["id"] == sys.argv[2]), ""))' \
        "$OUT/$1.doctor.json" "$2"
}

for phase in $PHASES; do
    case $phase in
    bare)
        doctor bare "$REPO" ;;
    installed)
        doctor installed "$SERVING_PATH"
        doctor installed-snapshot "$SERVING_PATH" --snapshot "$STATE/bundle/snapshot/sglang" ;;
    serve)
        "${RUN[@]}" serve plain --wait 540 && "${RUN[@]}" serve dflash --block 16 --wait 540 &&
            "${RUN[@]}" serve ddtree --block 16 --budget 64 --wait 540 ;;
    serving)
        doctor serving "$SERVING_PATH" "${PORTS[@]}" ;;
    leftover)
        launcher=$(cat "$STATE/plain.pid")
        children=$(pgrep -P "$launcher" | paste -sd, -)
        echo "leftover: SIGKILL to plain's launcher $launcher (children: $children)"
        kill -9 "$launcher"
        sleep 3
        # SGLang's children may die with their launcher (PR_SET_PDEATHSIG); record which stayed.
        [ -n "$children" ] && ps -o pid,ppid,comm,args -p "$children" | cut -c1-160
        doctor leftover "$SERVING_PATH" "${PORTS[@]}"
        fix=$(check_fix leftover gpu.leftovers)
        echo "leftover: doctor's fix: $fix"
        pids=$(sed -n 's/^kill \([0-9 ]*\) (.*/\1/p' <<<"$fix")
        if [ -n "$pids" ]; then
            # shellcheck disable=SC2086  # one pid per word
            kill $pids
            sleep 5
        fi
        rm -f "$STATE/plain.pid"
        doctor leftover-fixed "$SERVING_PATH" "${PORTS[@]}" ;;
    broken)
        wheel=$(ls "$STATE"/bundle/extra/sglang_kernel-0.4.6.post1-*.whl 2>/dev/null | head -1)
        if [ -z "$wheel" ]; then
            echo "broken: no sglang_kernel 0.4.6.post1 wheel in $STATE/bundle/extra" \
                "(make the bundle with prepare.py --broken-kernel)" >&2
            continue
        fi
        python3 -m pip install -q --no-index --no-deps --target "$BROKEN" "$wheel"
        doctor broken "$BROKEN_PATH" "${PORTS[@]}" ;;
    repaired)
        fix=$(check_fix broken kernels.sgl_kernel)
        echo "repaired: doctor's fix: $fix"
        pin=$(grep -o "'sglang-kernel==[^']*'" <<<"$fix" | tr -d "'" | head -1)
        if [ -z "$pin" ]; then
            echo "repaired: the fix names no sglang-kernel pin" >&2
            continue
        fi
        # The fix's own pip line, offline (the bundle's wheels) and aimed at the folder that
        # holds the broken copy: that copy is the one `import sgl_kernel` finds first.
        python3 -m pip install -q --no-index --find-links "$STATE/bundle/extra" \
            --find-links "$STATE/bundle/wheels" --no-deps \
            --upgrade --target "$BROKEN" "$pin"
        doctor repaired "$BROKEN_PATH" "${PORTS[@]}" ;;
    stop)
        "${RUN[@]}" stop all
        rm -rf "$BROKEN" ;;
    *)
        echo "unknown phase: $phase" >&2
        exit 2 ;;
    esac
done
