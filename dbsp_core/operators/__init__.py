"""The operators of a circuit, one per module (windows and the temporal ones too), and the StepContext they run in; the Circuit/Stream API in dbsp_core.circuit builds them."""

from dbsp_core.operators.aggregate import Aggregate
from dbsp_core.operators.base import Operator
from dbsp_core.operators.constant import Constant
from dbsp_core.operators.delay import Delay
from dbsp_core.operators.differentiate import Differentiate
from dbsp_core.operators.distinct import Distinct
from dbsp_core.operators.exchange import Exchange
from dbsp_core.operators.filter import Filter
from dbsp_core.operators.flat_map import FlatMap
from dbsp_core.operators.input import Input
from dbsp_core.operators.integrate import Integrate
from dbsp_core.operators.join import Join
from dbsp_core.operators.left_join import LeftJoin
from dbsp_core.operators.negate import Negate
from dbsp_core.operators.outer_join import OuterJoin
from dbsp_core.operators.plus import Plus
from dbsp_core.operators.select import Select
from dbsp_core.operators.semi_join import SemiJoin

__all__ = ["Aggregate", "Constant", "Delay", "Differentiate", "Distinct", "Exchange", "Filter", "FlatMap", "Input",
           "Integrate", "Join", "LeftJoin", "Negate", "Operator", "OuterJoin", "Plus", "Select", "SemiJoin"]
