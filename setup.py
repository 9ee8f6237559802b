"""Package-directory mapping: the top-level folders are the k3serve.<component> packages.

`operator/` deliberately has no __init__.py at its top so that running Python from the repo root
can never shadow the standard library's `operator` module; it is installed as the implicit
namespace package `k3serve.operator`.
"""
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
COMPONENTS = ["workers", "kernels", "router", "kvstore", "operator"]


def _packages():
    pkgs = {"k3serve": "k3serve"}
    for top, prefix in [("k3serve", "k3serve")] + [(c, f"k3serve.{c}") for c in COMPONENTS]:
        base = os.path.join(ROOT, top)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            if not any(f.endswith(".py") for f in filenames):
                continue
            rel = os.path.relpath(dirpath, base)
            name = prefix if rel == "." else prefix + "." + rel.replace(os.sep, ".")
            pkgs[name] = os.path.relpath(dirpath, ROOT)
    return pkgs


PKGS = _packages()
setup(
    packages=sorted(PKGS),
    package_dir={name: path for name, path in PKGS.items() if name.count(".") <= 1},
    package_data={"": ["*.proto", "*.json", "*.yaml", "*.txt"]},
    include_package_data=True,
)
