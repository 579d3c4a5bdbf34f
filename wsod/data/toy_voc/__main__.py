"""``python -m wsod.data.toy_voc stats``: what the VOC-like set holds (``wsod.data.toy_voc.stats``)."""

from wsod.data.toy_voc.stats import main

if __name__ == "__main__":
    raise SystemExit(main())
