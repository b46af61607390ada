"""The built wheel carries the reference and autotune packages inside the dspark_kernels namespace, and the assets."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contents(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("dspark_kernels-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in ("dspark_kernels/reference/verify_attention.py", "dspark_kernels/reference/rejection_sample.py",
                     "dspark_kernels/autotune/store.py", "dspark_kernels/ops/verify_attention.py",
                     "dspark_kernels/assets/target/model.safetensors", "dspark_kernels/assets/target/tokenizer.json",
                     "dspark_kernels/demo.py"):
        assert expected in names, expected
    assert not any(n.startswith(("reference/", "autotune/", "tests/")) for n in names)  # no generic top-level modules
