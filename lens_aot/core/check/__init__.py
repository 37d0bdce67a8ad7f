"""The check step: the certified bound a conversion states (faithfulness, one tolerance table), the bounds it is built
from, and the independent reference forward it is checked against."""
