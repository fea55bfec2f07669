"""The package list, found rather than written out: a regular install ships every subpackage.

Everything else is in pyproject.toml; setuptools reads `packages` from here because the plugins
folder installs under another name (`cacheproxy_plugins`), which `packages.find` cannot express.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["cacheproxy", "cacheproxy.*"]), "cacheproxy_plugins"])
