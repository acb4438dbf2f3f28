"""The packages the wheel holds, found rather than listed: colab_par/ with every subfolder, and the
top-level kernels/ folder (with any subfolder) as colab_par.kernels. pyproject.toml's table
cannot map one found folder to another name, hence this file; everything else is in pyproject.toml."""
from setuptools import find_packages, setup

KERNELS = ["colab_par.kernels", *(f"colab_par.kernels.{name}" for name in find_packages("kernels"))]

setup(packages=[*find_packages(include=["colab_par", "colab_par.*"]), *KERNELS],
      package_dir={"colab_par.kernels": "kernels"})
