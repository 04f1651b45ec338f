"""Imported by every Python process started with this directory on ``PYTHONPATH`` (``issue39_device.sh``'s
``swS`` sweep setting): ``sys.setswitchinterval(SF_SWITCH_INTERVAL)`` when it is set, for trying the GIL's
switch interval in stage processes without changing them."""

import os
import sys

if os.environ.get("SF_SWITCH_INTERVAL"):
    sys.setswitchinterval(float(os.environ["SF_SWITCH_INTERVAL"]))
