python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:.
git log --oneline 2>/dev/null | head -1
(time timeout -s INT 500 python -m pytest -q -p no:cacheprovider tests/test_step.py tests/test_gdn_step.py tests/test_splitk.py tests/test_fa_step.py tests/test_hybrid_lean.py tests/test_mlp_step.py) > $OUT/tests5.log 2>&1
grep -E "passed|failed|FAILED|^E " $OUT/tests5.log | head -30
tail -3 $OUT/tests5.log
