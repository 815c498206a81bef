"""The workbench's tests; the `conftest.py` of each folder holds what its tests share."""
