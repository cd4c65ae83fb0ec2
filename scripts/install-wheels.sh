# Sourced by the GPU-machine scripts (bash): install the wheels carried in .whl/ (peers such as
# liger-kernel, test-only packages such as expecttest; the GPU machine has no network) into /tmp/site
# and put that on PYTHONPATH. Needs $OUT (pip's log goes to $OUT/pip.log); uses $PYTHON or python3.
shopt -s nullglob
_wheels=(.whl/*.whl)
if ((${#_wheels[@]})); then
    if "${PYTHON:-python3}" -m pip install --no-deps --no-index --quiet --target /tmp/site "${_wheels[@]}" \
            >"$OUT/pip.log" 2>&1; then
        export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
    else
        echo "warning: installing ${_wheels[*]} failed (see pip.log)"
    fi
fi
unset _wheels
