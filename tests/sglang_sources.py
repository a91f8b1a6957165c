"""Unpack the Python source of SGLang releases for the version checks (``tests/test_sglang_versions.py``).

``python tests/sglang_sources.py DEST VERSION...`` downloads each release's wheel from the package index
(no dependencies) and keeps its ``sglang/`` Python files under ``DEST/<version>/``; a release already
there is skipped. ``make test`` runs it for the releases other than the installed one.
"""

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def unpack(dest: Path, version: str) -> Path:
    """``DEST/<version>`` holding that release's ``sglang/**.py``; downloads it when missing.

    Raises:
        subprocess.CalledProcessError: pip could not download the wheel.
    """
    out = dest / version
    marker = out / ".complete"
    if marker.exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64",
                        "--platform", "any", "-d", tmp, f"sglang=={version}"], check=True)
        (wheel,) = Path(tmp).glob("sglang-*.whl")
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith("sglang/") and name.endswith(".py"):
                    z.extract(name, out)
    marker.write_text(version + "\n")
    return out


if __name__ == "__main__":
    for v in sys.argv[2:]:
        print(unpack(Path(sys.argv[1]), v))
