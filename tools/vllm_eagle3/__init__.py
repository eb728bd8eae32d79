"""vllm-eagle3: the drafter tools of the EAGLE-3 series for vLLM 0.16.0
(doctor, show, check, convert, calibrate), installed as the ``vllm-eagle3``
command. In a clone of the series the same package is ``tools.vllm_eagle3``."""
