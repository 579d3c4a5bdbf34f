"""The VOC-like benchmark (``data=toy_voc``): its generator (``wsod.data.toy_voc.generator``) and its
stats report (``wsod.data.toy_voc.stats``, ``python -m wsod.data.toy_voc stats``)."""
