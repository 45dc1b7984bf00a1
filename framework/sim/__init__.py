"""The discrete-event cluster simulator (router + instances driving the real scheduler); its steps are priced by
a cost model (framework/sim/cost/, plugins in plugins/cost/)."""
