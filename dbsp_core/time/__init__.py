"""Event time: watermarks per input (watermark.py), the time lineage of streams (lineage.py), and the state cleanup they allow (cleanup.py); the windows and temporal operators built on them live in dbsp_core.operators."""

from dbsp_core.time.watermark import NO_WATERMARK, EventTime, advance, event_times

__all__ = ["NO_WATERMARK", "EventTime", "advance", "event_times"]
