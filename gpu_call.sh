set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:.
(time timeout 240 python -m pytest -q -p no:cacheprovider tests/test_step.py tests/test_fa_step.py -k "one or pdl or step or launch" ) > $OUT/tests2.log 2>&1
tail -8 $OUT/tests2.log
V="defaults"
for kv in BLOCKS_PER_SM=2 BLOCKS_PER_SM=3 BLOCKS_PER_SM=6 BLOCKS_PER_SM=8 NUM_WARPS=2 NUM_WARPS=8 BLOCK=128 BLOCK=32 NUM_STAGES=2 NUM_STAGES=4 MIN_SPLIT=1024; do V="$V $(echo $kv | tr 'A-Z=' 'a-z_'):splitk.$kv"; done
timeout 300 python benchmarks/profile_decode.py --out $OUT/sweep --batch 16 --length 32768 --reps 100 --variants $V > $OUT/sweep.log 2>&1
grep -E "speed-up" $OUT/sweep.log
grep -E "^(teacher|hybrid)" $OUT/sweep.log | sed -E 's/kernels.*one_launch ([0-9.]+us).*/one_launch \1/'
