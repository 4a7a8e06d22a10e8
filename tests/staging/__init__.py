"""Tests of staging: records from the step to the host, on the stand-in device and the GPU tools."""
