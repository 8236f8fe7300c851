#!/usr/bin/env bash
# One benchmark over several source trees on one machine, in turns: the way to compare commits whose difference
# is not a kernel setting (bench/step_ab.py compares settings on one install). On the machine with the repository:
#   for ref in main columns-dot; do mkdir -p ab_trees/$ref && git archive $ref | tar -x -C ab_trees/$ref; done
# then, on the CUDA machine (ab_trees/ is ignored by git: carry it), from the repository root:
#   OUT=results WHEELS=.whl TREES="ab_trees/main ab_trees/columns-dot" ROUNDS=2 \
#     BENCH="step_ab.py /tmp/q36.ninfer --routing trace --steps 10 --repeats 3" bench/commit_ab.sh
# Each tree is installed into a folder of its own; BENCH (a script of the tree's own bench/ and its arguments) runs
# from a copy of that bench/ with the tree's install first on the path, ROUNDS times in turns (A B A B: drift
# between the first and last run shows in the spread), each run with --out $OUT/<tree>_<round>.json and --commit
# <tree>; every run's output goes to one $OUT/commit_ab.log (few files: a device call returns a handful). The
# synthetic artifact /tmp/q36.ninfer, where BENCH reads it, is written once, by the first tree. ROUNDS=0 only
# installs the trees (a caller's own runs follow).
set -o pipefail
: "${OUT:?set OUT to the folder for the results}" "${TREES:?set TREES to the source trees}" "${BENCH:?set BENCH}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
site=/tmp/ab_site
mkdir -p "$site"
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site/wheels" "$WHEELS"/*.whl || exit 1
fi
for tree in $TREES; do
  name=$(basename "$tree")
  python3 -m pip install -q --no-deps --no-build-isolation --target "$site/$name" "$tree" > "$site/${name}_install.log" 2>&1 \
    || { tail -20 "$site/${name}_install.log"; exit 1; }
  rm -rf "$site/run_$name" && mkdir -p "$site/run_$name" && cp -r "$tree/bench" "$site/run_$name/"
done
first=$(basename "${TREES%% *}")
case "$BENCH" in *q36.ninfer*)
  [ -f /tmp/q36.ninfer ] || (cd "$site/run_$first" && PYTHONPATH="$site/$first:$site/wheels" python3 bench/make_synthetic.py /tmp/q36.ninfer \
    > "$site/synthetic.log" 2>&1) || { tail -20 "$site/synthetic.log"; exit 1; } ;;
esac
for round in $(seq 1 "${ROUNDS:-1}"); do
  for tree in $TREES; do
    name=$(basename "$tree")
    echo "== $name, round $round"
    (cd "$site/run_$name" && PYTHONPATH="$site/$name:$site/wheels" python3 bench/$BENCH --out "$OUT/${name}_$round.json" \
      --commit "$name" 2>&1 | tee -a "$OUT/commit_ab.log" | tail -6)
  done
done
