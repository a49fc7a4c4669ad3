"""Sphinx configuration: the API reference is generated from the docstrings (autodoc + napoleon).

Build: ``pip install -e ".[docs]" && python -m sphinx -E -W --keep-going -q -b html docs docs/_build/html``
(``.ci/run`` does this; warnings are errors).
"""

import adaptive_amp

project = "adaptive_amp"
author = "adaptive_amp contributors"
copyright = "2026, adaptive_amp contributors"
release = version = adaptive_amp.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]

# Google-style "Args:" / "Returns:" sections, as the docstrings are written.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_default_options = {"members": True, "member-order": "bysource", "show-inheritance": True}
autodoc_typehints = "description"
# The public names are re-exported by adaptive_amp; document them where users import them.
add_module_names = False
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = []


# --------------------------------------------------------------------------- docstrings that are not reST
# A docstring that reStructuredText misreads (an indented plain-text list, |y| for an absolute value)
# would render as garbled text. Each one is a warning (an error under -W, as CI builds): fix it at the
# source. ADAPTIVE_AMP_DOCS_LENIENT=1 shows such docstrings verbatim instead, for a quick local build.
import io
import os
import re

import docutils.core
import docutils.utils
from sphinx.util import logging

_ROLE = re.compile(r":[\w:]+:`([^`]*)`")
_verbatim = []


def _parses_cleanly(lines):
    text = _ROLE.sub(lambda m: f"``{m.group(1)}``", "\n".join(lines))  # Sphinx roles are unknown to docutils
    stream = io.StringIO()
    try:
        docutils.core.publish_doctree(text, settings_overrides={"report_level": 2, "halt_level": 5,
                                                                "warning_stream": stream})
    except docutils.utils.SystemMessage:
        return False
    return not stream.getvalue()


def _verbatim_if_needed(app, what, name, obj, options, lines):
    if not lines or _parses_cleanly(lines):
        return
    _verbatim.append(name)
    if os.environ.get("ADAPTIVE_AMP_DOCS_LENIENT") != "1":
        logging.getLogger(__name__).warning(f"{name}: docstring is not valid reStructuredText; fix it at the "
                                            "source (ADAPTIVE_AMP_DOCS_LENIENT=1 shows it verbatim)")
    lines[:] = ["::", ""] + ["    " + line for line in lines] + [""]


def _summary(app, exception):
    if _verbatim:
        logging.getLogger(__name__).info(f"docstrings shown verbatim (plain text, not reST): {', '.join(_verbatim)}")


def setup(app):
    app.connect("autodoc-process-docstring", _verbatim_if_needed, priority=900)  # after napoleon's rewrite
    app.connect("build-finished", _summary)
