"""What every rank of tests/multiprocess/test_calibrate_launched.py runs: ``gt.calibrate()`` on the
process world (its timings of collectives and of bucketed backwards call the same collectives the
same number of times on every rank), printed as a ``GT {json}`` record."""
import json

import globaltensor as gt

if __name__ == "__main__":
    cal = gt.calibrate(small=4096, large=65536, repeats=2)
    print("GT " + json.dumps(cal.to_dict()), flush=True)
