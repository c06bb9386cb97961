python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:.
(time timeout 150 python -m pytest -q -p no:cacheprovider tests/test_mlp_step.py tests/test_step.py -k "bf16 or kernels or one" ) > $OUT/tests3.log 2>&1
tail -4 $OUT/tests3.log
for B in 16 1; do
timeout 120 python benchmarks/profile_decode.py --out $OUT/pd3_b$B --batch $B --length 32768 --reps 200 --variants defaults mlpoff:static.MLP_KERNEL=False before:static.MLP_KERNEL=False,lean.DECODE_ONE_LAUNCH=False > $OUT/pd3_b$B.log 2>&1
grep -E "^(teacher|hybrid)|speed-up" $OUT/pd3_b$B.log
done
timeout 230 python benchmarks/bench_hybrid.py --out $OUT/layer --no-before --no-graph-prefill --graph-block 0 --shapes smollm2-135m --lengths 32768 131072 --variants triton_splitk one_launch devpos_one_launch --graph-reps 200 --eager-reps 5 --budget-s 200 > $OUT/layer.log 2>&1
tail -5 $OUT/layer.log
python - <<'P'
import json,os
r=json.load(open(os.environ["OUT"]+"/layer/bench_hybrid.json"))
for k,v in r["bench"].items():
    if "fa" not in v: print(k, v); continue
    print(k, {n: {kk: vv for kk, vv in v[n].items() if "decode_graph" in kk} for n in ("fa","hybrid")})
    print(k, {kk: vv for kk, vv in v.get("parity", {}).items() if "decode" in kk})
P
