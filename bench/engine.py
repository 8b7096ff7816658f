"""Native engine throughput; see ``hybridpd.benchmarks.engine`` (also ``hybridpd bench eagle``)."""

from hybridpd.benchmarks.engine import main

if __name__ == "__main__":
    main()
