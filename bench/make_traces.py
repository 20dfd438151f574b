"""Generate the synthetic traces shipped under bench/traces/ and their decode histograms.

    python3 bench/make_traces.py            # writes bench/traces/{low,moderate,high}.csv
                                            # and bench/traces/{low,moderate,high}.hist.csv

Loads, rates, seeds and length distributions: graphserving.planner.traces.SYNTHETIC_LOADS
(Poisson arrivals, log-normal prompt and output lengths). Histograms: the decode batch sizes of
graphserving.planner.traces.simulate_decode_batches at max_num_seqs 256. Deterministic: running
it again rewrites identical files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from graphserving.planner.histogram import from_batch_sizes
from graphserving.planner.traces import SYNTHETIC_LOADS, simulate_decode_batches, synthetic_trace, trace_to_csv

MAX_NUM_SEQS = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "traces"), help="output folder")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for load in SYNTHETIC_LOADS:
        trace = synthetic_trace(load.rate_rps, load.num_requests, load.seed)
        (out / f"{load.name}.csv").write_text(trace_to_csv(trace))
        histogram = from_batch_sizes(simulate_decode_batches(trace, max_num_seqs=MAX_NUM_SEQS))
        (out / f"{load.name}.hist.csv").write_text(histogram.to_csv())
        print(f"{load.name}: {len(trace)} requests at {load.rate_rps} rps (seed {load.seed}), "
              f"{int(histogram.total)} decode steps")


if __name__ == "__main__":
    main()
