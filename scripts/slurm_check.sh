#!/usr/bin/env bash
# A real SLURM run on one CPU machine: bash scripts/slurm_check.sh [--section.key value ...]
#
# Installs SLURM and munge from the OS packages when missing (apt; needs root or passwordless
# sudo), starts munged, slurmctld and two slurmd ("nodes" n1 and n2: one host, two ports) in a
# fresh temporary folder, and submits
#     sbatch --nodes 2 scripts/slurm_train.sbatch configs/debug.toml --training.steps STEPS [ARGS]
# with one CPU process per node (NPROC_PER_NODE=1, gloo): the job must end COMPLETED, exit code 0,
# with every step of both nodes in its log, global rank 0 on the first node and every step in
# metrics.jsonl. A second job with a bad config must fail with exit code 2 and the one config error
# line. The daemons it started are stopped on any exit. Exit status 0 on success, else 1 and a
# "slurm_check: ..." line (the folder with the daemons' logs is kept; KEEP=1 keeps it always).
# STEPS (default 3) and TIMEOUT (seconds per job, default 300) from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${STEPS:-3}
timeout=${TIMEOUT:-300}
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || echo python3 )}
fail() { echo "slurm_check: $*" >&2; exit 1; }
export PATH=$PATH:/usr/sbin:/sbin  # the daemons live there, outside a plain user's PATH

if [ "$(id -u)" = 0 ]; then as_root=(); elif sudo -n true 2>/dev/null; then as_root=(sudo -n);
else fail "needs root or passwordless sudo (to install and start slurmctld, slurmd, munged)"; fi

# --- install (idempotent: apt only when a command is missing) ------------------------------
missing=$(for cmd in slurmctld slurmd sbatch munged mungekey; do command -v "$cmd" > /dev/null || echo "$cmd"; done)
if [ -n "$missing" ]; then
    command -v apt-get > /dev/null || fail "slurm is not installed and there is no apt-get to install it"
    echo "slurm_check: installing slurmctld slurmd slurm-client munge from apt (missing:" $missing")"
    install=("${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends
             slurmctld slurmd slurm-client munge)
    "${install[@]}" > /dev/null 2>&1 || { "${as_root[@]}" apt-get update -q > /dev/null 2>&1 &&
        "${install[@]}" > /dev/null; } || fail "could not install slurmctld slurmd slurm-client munge with apt-get"
fi

# --- a private cluster in a fresh folder: its own munge socket, ports, state and logs --------
work=$(mktemp -d "${TMPDIR:-/tmp}/slurm-check.XXXXXX")
chmod 755 "$work"  # the job (the current user) reads slurm.conf; daemons run as root
job_id=
alive() { local stat; stat=$(ps -o stat= -p "$1") && [ "${stat:0:1}" != Z ]; }  # a zombie is gone
cleanup() {
    status=$?
    trap - EXIT INT TERM
    set +e
    if [ -n "$job_id" ]; then  # cancel it while the daemons that end its processes still run
        scancel "$job_id" 2> /dev/null || true
        for _ in $(seq 60); do [ -z "$(squeue -h -j "$job_id" 2> /dev/null)" ] && break; sleep 0.5; done
    fi
    # slurmd first, munged last: a daemon stopping still talks to the others
    for name in slurmd-n1 slurmd-n2 slurmctld munged; do
        pid=$(cat "$work/$name.pid" 2> /dev/null) || continue
        "${as_root[@]}" kill "$pid" 2> /dev/null || continue
        for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
        alive "$pid" && "${as_root[@]}" kill -9 "$pid" 2> /dev/null
    done
    if [ "$status" = 0 ] && [ -z "${KEEP:-}" ]; then "${as_root[@]}" rm -rf "$work"
    else echo "slurm_check: daemons' logs kept in $work" >&2; fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

read -r ctld_port n1_port n2_port rdzv_port < <("$py" -c '
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
host=$(hostname -s)
mkdir -p "$work"/state "$work"/out
"${as_root[@]}" mungekey --create --keyfile "$work/munge.key"
"${as_root[@]}" munged --force --socket "$work/munge.sock" --key-file "$work/munge.key" \
    --pid-file "$work/munged.pid" --log-file "$work/munged.log" --seed-file "$work/munged.seed" ||
    fail "munged did not start ($work/munged.log)"

cat > "$work/slurm.conf" << EOF
ClusterName=slurmcheck
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$work/munge.sock
StateSaveLocation=$work/state
SlurmctldPidFile=$work/slurmctld.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdSpoolDir=$work/spool-%n
SlurmdPidFile=$work/slurmd-%n.pid
SlurmdLogFile=$work/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdTimeout=60
MinJobAge=600
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$n1_port CPUs=1 State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$n2_port CPUs=1 State=UNKNOWN
PartitionName=check Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$work/slurm.conf
"${as_root[@]}" env SLURM_CONF="$SLURM_CONF" slurmctld -i || fail "slurmctld did not start ($work/slurmctld.log)"
for node in n1 n2; do
    "${as_root[@]}" env SLURM_CONF="$SLURM_CONF" slurmd -N "$node" || fail "slurmd $node did not start ($work/slurmd-$node.log)"
done
for _ in $(seq 60); do
    [ "$(sinfo -h -N -t idle -o %N 2> /dev/null | sort -u | wc -l)" = 2 ] && break
    sleep 0.5
done
[ "$(sinfo -h -N -t idle -o %N | sort -u | wc -l)" = 2 ] ||
    fail "the two nodes did not come up idle: $(sinfo -h -N -o '%N %t' | tr '\n' ' ')(logs in $work)"

# --- the jobs: the sbatch template as a cluster runs it, one CPU process per node -------------
# submit ARGS...: runs scripts/slurm_train.sbatch configs/debug.toml ARGS on both nodes and waits;
# sets job (its id), state, exit_code, owner, nodes and log.
submit() {
    job_id=$(PYTHON=$py NPROC_PER_NODE=1 MASTER_PORT=$rdzv_port OMP_NUM_THREADS=1 NO_COLOR=1 \
        sbatch --parsable --nodes 2 --gpus-per-node=0 --cpus-per-task=1 --time 10 \
        --output "$work/out/slurm-%j.log" scripts/slurm_train.sbatch configs/debug.toml "$@") ||
        fail "sbatch refused the job"
    job=$job_id log=$work/out/slurm-$job_id.log started=$SECONDS
    while :; do
        info=$(scontrol show job "$job")
        state=$(sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<< "$info")
        case $state in PENDING|CONFIGURING|RUNNING|COMPLETING|"") ;; *) break ;; esac
        [ $((SECONDS - started)) -lt "$timeout" ] || fail "job $job still $state after ${timeout}s (log $log)"
        sleep 1
    done
    job_id=
    exit_code=$(sed -n 's/.* ExitCode=\([0-9:]*\).*/\1/p' <<< "$info")
    owner=$(sed -n 's/.*UserId=\([^(]*\)(.*/\1/p' <<< "$info")
    nodes=$(sed -n 's/^ *NodeList=\([^ ]*\).*/\1/p' <<< "$info")
}

# Training: both nodes rendezvous at the first node's address and train; global rank 0 (the
# only one that writes metrics.jsonl and sleeps before exiting) must be on node 0.
dump=$work/out/debug
submit --training.steps "$steps" --lr_scheduler.warmup_steps 1 --job.dump_folder "$dump" "$@"
[ "$state" = COMPLETED ] && [ "$exit_code" = 0:0 ] ||
    fail "job $job ended $state, exit code $exit_code; its log: $(tail -n 20 "$log" 2> /dev/null)"
[ "$owner" = "$(id -un)" ] || fail "job $job ran as $owner, not as $(id -un)"
[ "$nodes" = "n[1-2]" ] || fail "job $job ran on $nodes, not n[1-2]"
for step in $(seq "$steps"); do
    for node in 0 1; do
        grep -q "^$node: .*step: *$step " "$log" || fail "node $node's step $step is not in the job's log $log"
    done
done
grep -q "^0: .*Sleeping 2 seconds for other ranks" "$log" || fail "global rank 0 is not on node 0 (node rank): $log"
logged=$("$py" -c 'import json, sys; print(sum(1 for l in open(sys.argv[1]) if "loss" in json.loads(l)))' \
    "$dump/metrics.jsonl" 2> /dev/null || echo 0)
[ "$logged" = "$steps" ] || fail "metrics.jsonl holds $logged steps, not $steps"
trained=$job

# A refusal: the config check stops the job before srun, its log is the one config error line.
submit --moe.align 3
[ "$state" = FAILED ] && [ "$exit_code" = 2:0 ] || fail "job $job (a bad [moe] align) ended $state, exit code $exit_code"
[ "$(cat "$log")" = "config error: [moe] align = 3: must be one of 8, 16, 32" ] ||
    fail "job $job's log is not the one config error line: $(head -c 600 "$log")"
echo "slurm_check: job $trained trained $steps steps on $nodes as $(id -un), COMPLETED;" \
     "job $job refused a bad config in one line; ${SECONDS}s"
