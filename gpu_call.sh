python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:.
(time timeout 260 python -m pytest -q -p no:cacheprovider tests/test_step.py tests/test_mlp_step.py tests/test_hybrid_graphs.py tests/test_fa_step.py tests/test_hybrid_lean.py) > $OUT/tests4.log 2>&1
tail -6 $OUT/tests4.log
timeout 300 python benchmarks/profile_decode.py --out $OUT/pd4 --batch 16 --length 32768 --reps 200 --tail-modes default max-autotune-no-cudagraphs > $OUT/pd4.log 2>&1
grep -E "^(teacher|hybrid)|speed-up" $OUT/pd4.log
tail -3 $OUT/pd4.log
