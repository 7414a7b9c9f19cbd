"""Low-level readers (sysfs, hwmon, NVML) shared by the collectors and the node helper."""
