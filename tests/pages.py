"""Reading report.html in tests: its markup apart from the inline scripts its Content-Security-Policy allows."""

from __future__ import annotations

import base64
import hashlib
import re

_CSP = re.compile(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">')
_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


def allowed_scripts(html: str) -> list[str]:
    """The page's inline scripts, each checked to be one its Content-Security-Policy allows by hash (no other
    script could run)."""
    (csp,) = _CSP.findall(html)
    allowed = set(re.findall(r"'sha256-([A-Za-z0-9+/=]+)'", csp))
    scripts = _SCRIPT.findall(html)
    for script in scripts:
        digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode()
        assert digest in allowed, "an inline script the page's Content-Security-Policy does not allow"
    return scripts


def markup_outside_scripts(html: str) -> str:
    """report.html without its allowed inline scripts (checked by :func:`allowed_scripts`): the markup built
    from the evidence, which must hold no script or element from the data."""
    allowed_scripts(html)
    return _SCRIPT.sub("", html)
