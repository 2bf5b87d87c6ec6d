#!/usr/bin/env bash
# Run commands side by side as test lanes (`make test`; see the Makefile, "Lanes").
#
#   scripts/lanes.sh LOG_DIR NAME=COMMAND [NAME=COMMAND ...]
#
# The first lane's output streams to this terminal; every other lane's goes to
# LOG_DIR/<name>.log and is printed whole, under a header, once all lanes have ended (so
# the CI log holds each lane in one piece). Each lane gets HUTCH_TEST_LANE=<name> (the
# suite names its reports and picks its lane's port range by it). The exit status is 0
# only if every lane exited 0; an interrupt stops every lane (its whole process group).
set -uo pipefail

if [ $# -lt 2 ]; then
	echo "usage: $0 LOG_DIR NAME=COMMAND [NAME=COMMAND ...]" >&2
	exit 2
fi
log_dir=$1
shift
mkdir -p "$log_dir"

names=()
pids=()
start=$(date +%s)
# Each lane in its own process group (set -m), so an interrupt can stop all of one.
set -m
first=1
for spec in "$@"; do
	name=${spec%%=*}
	cmd=${spec#*=}
	names+=("$name")
	rm -f "$log_dir/$name.log" "$log_dir/$name.rc" "$log_dir/$name.end"
	if [ $first = 1 ]; then
		(HUTCH_TEST_LANE=$name bash -c "$cmd" </dev/null; rc=$?; echo $rc >"$log_dir/$name.rc"
		 date +%s >"$log_dir/$name.end"; exit $rc) &
		first=0
	else
		(HUTCH_TEST_LANE=$name bash -c "$cmd" >"$log_dir/$name.log" 2>&1 </dev/null; rc=$?
		 echo $rc >"$log_dir/$name.rc"; date +%s >"$log_dir/$name.end"; exit $rc) &
		echo "lanes: lane $name runs beside lane ${names[0]}: its log is $log_dir/$name.log" \
			"(printed here when every lane has ended)"
	fi
	pids+=($!)
done
set +m

stop_lanes() {
	echo "lanes: interrupted, stopping every lane" >&2
	for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
	wait
	exit 130
}
trap stop_lanes INT TERM

for pid in "${pids[@]}"; do wait "$pid"; done
trap - INT TERM

status=0
summary=()
for i in "${!names[@]}"; do
	name=${names[$i]}
	rc=$(cat "$log_dir/$name.rc" 2>/dev/null || echo 255)
	end=$(cat "$log_dir/$name.end" 2>/dev/null || date +%s)
	secs=$((end - start))
	summary+=("lane $name: exit $rc after $((secs / 60))m$((secs % 60))s")
	[ "$rc" = 0 ] || status=1
	if [ "$i" -gt 0 ]; then
		echo
		echo "=================== lane $name (exit $rc; from $log_dir/$name.log) ==================="
		cat "$log_dir/$name.log"
		echo "=================== end of lane $name ==================="
	fi
done
echo
total=$(($(date +%s) - start))
for line in "${summary[@]}"; do echo "lanes: $line"; done
echo "lanes: all lanes took $((total / 60))m$((total % 60))s; $([ $status = 0 ] && echo ok || echo FAILED)"
exit $status
